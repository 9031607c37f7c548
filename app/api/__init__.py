"""The HTTP API (``ctrps serve``): predictions, weights, model info, the
status board, exports, metrics and the dashboard, of one or many models.

`server` (`create_app` and its route table, `ApiServer`, `run_api`),
`routes` (the handlers), `answers` (the wrapper every route is served
through: errors, JSON replies, request bodies), `state` (the app's keys),
`payloads` (the request and response models), `openapi` (the document),
`errors` (the API's typed errors), `predictor` (batched predictions and
weight look-ups), `served_models` (a predictor per model served, and the
dashboard's histories), `history` (the dashboard's samples), `views` (what
the API reads of the cluster: shards or a replica) and `follower` (a serving
replica of the exports). The dashboard's page is `static/dashboard.html`.

May import `ps_core`, `consumers`, `app.api` and of the rest of `app` only
`app.config`, `app.security`, `app.logs`, `app.metrics`, `app.status`,
`app.failures`, `app.background`, `app.signals` and `app.startup`: never the
CLI, a command or a composition. The names below are imported on first use.
"""

from typing import TYPE_CHECKING

from ps_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .server import ApiServer, Sources, create_app, run_api
else:
    __getattr__, __dir__ = lazy_exports(__name__, {".server": ("ApiServer", "Sources", "create_app", "run_api")})

__all__ = ["ApiServer", "Sources", "create_app", "run_api"]
