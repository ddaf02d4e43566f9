"""Datasets: the registry (`load_rows`), sources and normalization, prompt templates, the
generated toy task and `stapoctl data prep`."""

from stapoctl.data.registry import DATASETS, load_rows
from stapoctl.data.sources import BENCHMARKS

__all__ = ["BENCHMARKS", "DATASETS", "load_rows"]
