"""decode_records, and merging the decodings of consecutive chunks."""

from __future__ import annotations

import numpy as np
import orjson

from consumers.decode import decode_records, merge_decoded


def test_chunked_decoding_merges_to_the_whole() -> None:
    values: list[bytes | None] = []
    for i in range(40):
        if i % 7 == 3:
            values.append(b"{broken")
        elif i % 11 == 5:
            values.append(orjson.dumps([{"label": 1, "keys": [i]}, {"label": 0, "features": {"a": str(i)}}]))
        else:
            values.append(orjson.dumps({"label": i % 2, "features": {"a": str(i), "n": i}}))
    whole = decode_records(values, "m", 1 << 20)
    sizes = [5, 1, 13, 21]
    parts, start = [], 0
    for size in sizes:
        parts.append(decode_records(values[start : start + size], "m", 1 << 20))
        start += size
    merged = merge_decoded(parts, sizes)
    for field in ("keys", "values", "offsets", "labels", "index"):
        np.testing.assert_array_equal(getattr(merged.batch, field), getattr(whole.batch, field), err_msg=field)
    assert merged.record_of == whole.record_of
    assert [(r.index, r.reason) for r in merged.rejected] == [(r.index, r.reason) for r in whole.rejected]
    assert {r.index for r in whole.rejected} == {i for i in range(40) if i % 7 == 3}
