"""The local file each dataset is read from: present, UTF-8, not empty, with problem and answer."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from stapoctl.errors import UserError


def check_dataset(conf: DictConfig, name: str, flag: str = "data.name", *, hub: bool = True) -> None:
    """The local file a dataset is read from: present, UTF-8, not empty, with problem and answer."""
    from stapoctl.data import sources as S
    from stapoctl.data.origin import find_origin

    name = S.canonical_name(name)
    if S.SOURCES[name].kind == "toy":
        return
    source = conf.data.source if S.canonical_name(str(conf.data.name)) == name else None
    if source and not Path(str(source)).expanduser().is_file():
        raise UserError(f"data.source={source}: no such file (give a .jsonl or .parquet path, or drop data.source)")
    origin = find_origin(name, conf.data, source, include_prepped=True)
    if origin.label.startswith("hub:"):  # downloaded (and checked) by `datasets` when loaded
        from stapoctl.preflight.hub import check_hub_dataset

        if hub:
            check_hub_dataset(origin.label.removeprefix("hub:"), f"{flag} {name}")
        return
    key = "data.source" if source else f"{flag} {name} ({origin.label})"
    _peek_rows(Path(origin.label), name, key)


def _peek_rows(path: Path, name: str, key: str, rows: int = 50) -> None:
    from stapoctl.data import sources as S

    if path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise UserError(f"{key}: {path} is a '{path.suffix}' file: give a .jsonl or .parquet file")
    if path.suffix.lower() in (".jsonl", ".json"):
        try:
            with open(path, encoding="utf-8") as fh:
                fh.read()
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{key}: {path} is not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
                "re-save it as UTF-8"
            ) from None
    first_problem = None
    try:
        for seen, (index, raw) in enumerate(S.read_file(path), start=1):
            try:
                S.normalize(S.SOURCES[name], raw, index - 1)
                return  # one usable row: the loader reports (and skips) any malformed ones
            except S.MalformedRow as exc:
                if first_problem is None:
                    columns = f" (columns: {', '.join(sorted(raw))})" if isinstance(raw, dict) else ""
                    first_problem = f"line {index}: {exc}{columns}"
            if seen >= rows:
                break
    except UserError:
        raise
    except Exception as exc:  # a parquet file that is not one, a truncated file, ...
        raise UserError(f"{key}: cannot read {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    if first_problem is None:
        raise UserError(f"{key}: {path} has no rows: give a file with one JSON object per line")
    raise UserError(
        f"{key}: no usable row in the first {rows} of {path}; {first_problem}: each row needs "
        "'problem' (or 'question' / chat 'prompt') and 'answer'"
    )


def train_dataset(conf: DictConfig) -> str:
    from stapoctl.data.sources import canonical_name

    try:
        name = canonical_name(str(conf.data.name))
    except UserError as exc:
        raise UserError(f"data.name={conf.data.name}: {exc}") from None
    return "toy-train" if name == "toy" else name
