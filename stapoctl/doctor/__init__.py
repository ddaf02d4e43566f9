"""`stapoctl doctor`: a self-test of the machine or cluster a run would use, in minutes.

One row per check (versions, GPUs, all-reduce, a vLLM engine, the learner → vLLM weight sync,
MLflow, model and data, SLURM, disk), PASS / FAIL / N/A; exit 0 only when every applicable row
passes. `rows.py` the rows and the table, `runner.py` the checks in order, `command.py` where
they run (here, a Ray job, a SLURM job: `remote.py`, whose job body is `job.py`).
"""
