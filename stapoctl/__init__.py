"""stapoctl: experiment orchestrator for RL of LLM reasoning (STAPO and neighbours)."""

__version__ = "0.1.0"
