"""Child side of the verifier pool: answers equivalence checks read as JSON lines on stdin.

A separate interpreter (not a fork of the caller) so it works the same under pytest, the
trainer driver and inside Ray actors, and so a check stuck in sympy can be killed outright.
Protocol: parent writes {"id", "pred", "ref", "kind"} (kind: the gold's answer kind or
null, `reward.lists`); child writes {"ready": true} once, then
{"id", "ok"} per check, with "error": "<exception type>" when the check raised (MemoryError under
the address-space cap, RecursionError, ...). Nothing else may reach the protocol stream.

Test hook (tests/test_reward_pool.py): with STAPOCTL_TEST_VERIFY_FAULT=KIND:ANSWER in the
environment, checking the predicted answer ANSWER crashes the child for real: KIND segv raises
SIGSEGV, exit calls os._exit(3), oom allocates past the memory cap (MemoryError). Unset, the
variable costs one dict lookup at start-up.
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


def _fault_hook() -> tuple[str, str] | None:
    spec = os.environ.get("STAPOCTL_TEST_VERIFY_FAULT")
    if not spec or ":" not in spec:
        return None
    kind, answer = spec.split(":", 1)
    return kind, answer


def _inject(kind: str) -> None:
    if kind == "segv":
        import faulthandler

        faulthandler._sigsegv()  # a real segmentation fault, as a crashing C extension gives
    elif kind == "exit":
        os._exit(3)
    elif kind == "oom":
        bytearray(1 << 50)  # 1 PiB: past any RLIMIT_AS cap, raises MemoryError


def main() -> None:
    # keep the protocol on a private fd; anything printed by libraries goes to stderr
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _limit_memory(float(os.environ.get("STAPOCTL_VERIFY_MAX_GB", "4")))

    from stapoctl.reward.equivalence import equivalent_unbounded

    equivalent_unbounded("\\frac{1}{2}", "0.5")  # import and warm up sympy before saying ready
    fault = _fault_hook()
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        reply = {"id": req["id"], "ok": False}
        try:
            if fault and req["pred"] == fault[1]:
                _inject(fault[0])
            reply["ok"] = bool(equivalent_unbounded(req["pred"], req["ref"], req.get("kind")))
        except Exception as exc:  # MemoryError, RecursionError: never die on one bad answer, say so
            reply["error"] = type(exc).__name__
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
