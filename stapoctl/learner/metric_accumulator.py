"""Micro-batch loss metrics combined into a step's metrics, across micro-batches, mini-batches
and data-parallel ranks."""

from __future__ import annotations


class MetricAccumulator:
    """Micro-batch metrics → mini-batch (sum the loss, token-weight the ratios, take the max of
    maxima) → step mean (max for maxima).

    With several ranks, each mini-batch's partial results are combined over the ranks, so the
    metrics describe the whole mini-batch (as one rank holding it all would report them).
    """

    # the loss library normalises these by the mini-batch: each micro-batch holds its share
    SUM_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "stapo/spurious_count",
                "loss/response_tokens")
    # NaN by design where a mini-batch has nothing to measure (a shadow's gradient share when every
    # advantage is 0): the step's mean is over the mini-batches that have a value, not a 0 for the rest;
    # every other NaN stays visible
    UNDEFINED_OK = ("shadow/",)

    def __init__(self, gather=None) -> None:
        self.gather = gather or (lambda obj: [obj])
        self.mini: list[dict[str, float]] = []
        self.cur: dict[str, list[float]] = {}  # key → [value, weight]

    @classmethod
    def kind(cls, key: str) -> str:
        if key in cls.SUM_KEYS or key.endswith("_count"):
            return "sum"
        return "max" if key.endswith("_max") else "mean"

    def add(self, m: dict) -> None:
        w = float(m.get("loss/response_tokens", 1.0)) or 0.0
        for k, v in m.items():
            v, kind = float(v), self.kind(k)
            if v != v and k.startswith(self.UNDEFINED_OK):
                continue
            acc = self.cur.setdefault(k, [float("-inf") if kind == "max" else 0.0, 0.0])
            if kind == "sum":
                acc[0] += v
            elif kind == "max":
                acc[0] = max(acc[0], v)
            else:
                acc[0] += v * w
                acc[1] += w

    def end_minibatch(self) -> None:
        merged: dict[str, list[float]] = {}
        for part in self.gather(self.cur):
            for k, (v, w) in part.items():
                if k not in merged:
                    merged[k] = [v, w]
                elif self.kind(k) == "max":
                    merged[k][0] = max(merged[k][0], v)
                else:
                    merged[k][0] += v
                    merged[k][1] += w
        out = {}
        for k, (v, w) in merged.items():
            out[k] = v if self.kind(k) != "mean" else (v / w if w > 0 else 0.0)
        self.mini.append(out)
        self.cur = {}

    def result(self) -> dict[str, float]:
        if not self.mini:
            return {}
        keys = set().union(*self.mini)  # an UNDEFINED_OK key no mini-batch had is not in it: not logged
        return {k: (max(m.get(k, float("-inf")) for m in self.mini) if self.kind(k) == "max"
                    else self._mean(k)) for k in keys}

    def _mean(self, k: str) -> float:
        if not k.startswith(self.UNDEFINED_OK):
            return sum(m.get(k, 0.0) for m in self.mini) / len(self.mini)
        have = [m[k] for m in self.mini if k in m]
        return sum(have) / len(have)
