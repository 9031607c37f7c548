"""The state of an API application, under its `web.AppKey`s (nothing is
global): its settings, reader, cluster view, models served and their
predictors, metrics, history, documents and the follower of a replica.
`app.api.create_app` sets them; the routes (`app.api.routes`) read them."""

from __future__ import annotations

import msgspec
from aiohttp import web

from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import Model
from ps_core.net.client import PSReader

from ..config.serve import ApiSettings
from ..metrics import ApiMetrics
from .follower import Follower
from .history import History
from .payloads import PredictRequest
from .predictor import Predictor
from .served_models import ServedModels
from .views import ClusterView

__all__ = [
    "SETTINGS",
    "CLIENT",
    "VIEW",
    "CONTROL",
    "MODEL",
    "PREDICTOR",
    "METRICS",
    "HISTORY",
    "SERVED",
    "OPENAPI",
    "FOLLOWER",
    "OPENAPI_BODY",
    "PREDICT_DECODER",
    "ERROR_LOG",
    "READINESS",
]

SETTINGS = web.AppKey("settings", ApiSettings)
CLIENT = web.AppKey("client", PSReader)
"""The reader the app pulls weights with (instrumented: every call timed)."""
VIEW: web.AppKey[ClusterView] = web.AppKey("view")
"""The shards' stats and status board: the control plane's, or a replica's."""
CONTROL: web.AppKey[ControlClient | None] = web.AppKey("control")
"""The training cluster's control plane (exports, status reports); None on a replica."""
MODEL = web.AppKey("model", Model)
"""The API's own model: the one a request naming none means."""
PREDICTOR = web.AppKey("predictor", Predictor)
METRICS = web.AppKey("metrics", ApiMetrics)
HISTORY = web.AppKey("history", History)
SERVED = web.AppKey("served", ServedModels)
"""The dashboard's samples of the cluster, taken while the app runs."""
OPENAPI = web.AppKey("openapi", dict)
"""The OpenAPI document (a dict)."""
FOLLOWER = web.AppKey("follower", Follower)
"""Present on a serving replica: what it serves and how it follows the exports."""
OPENAPI_BODY = web.AppKey("openapi_body", bytes)
PREDICT_DECODER: web.AppKey[msgspec.json.Decoder[PredictRequest]] = web.AppKey("predict_decoder")
"""`PredictRequest`'s decoder, bounded by `ApiSettings.max_events`."""
ERROR_LOG = web.AppKey("error_log", dict)
READINESS = web.AppKey("readiness", list)
"""``[last answer of /readyz: None (not asked yet), True or False]``."""
