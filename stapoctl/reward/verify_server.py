"""Child side of the verifier pool: answers equivalence checks read as JSON lines on stdin.

A separate interpreter (not a fork of the caller) so it works the same under pytest, the
trainer driver and inside Ray actors, and so a check stuck in sympy can be killed outright.
Protocol: parent writes {"id", "pred", "ref"}; child writes {"ready": true} once, then
{"id", "ok"} per check. Nothing else may reach the protocol stream.
"""

from __future__ import annotations

import json
import os
import sys


def _limit_memory(max_gb: float) -> None:
    """A pathological power tower can also eat memory: cap it so the machine survives."""
    if max_gb <= 0:
        return
    import resource

    limit = int(max_gb * 1024**3)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    # keep the protocol on a private fd; anything printed by libraries goes to stderr
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _limit_memory(float(os.environ.get("STAPOCTL_VERIFY_MAX_GB", "4")))

    from stapoctl.reward.equivalence import equivalent_unbounded

    equivalent_unbounded("\\frac{1}{2}", "0.5")  # import and warm up sympy before saying ready
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            ok = equivalent_unbounded(req["pred"], req["ref"])
        except Exception:  # MemoryError, RecursionError, sympy errors: never die on one bad answer
            ok = False
        proto.write(json.dumps({"id": req["id"], "ok": bool(ok)}) + "\n")


if __name__ == "__main__":
    main()
