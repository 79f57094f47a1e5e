"""Every engine in the registry has the parts a reader can name (facts, program format, kind, process start and,
for CKKS engines, the record's client, server, capabilities and cost traits), and its program format claims a
saved program of its own kind and no other engine's. Parametrised over the registry, so a new engine folder is
checked as soon as its registry line exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from polyfhe.program.engine_api import Backend, BackendUnavailable, CostTraits, EngineFacts, ProgramFormat
from polyfhe.program.engines import (
    BACKEND_NAMES,
    engine_facts,
    engine_names,
    get_backend,
    kind_of,
    load_other_format,
    load_served_program,
    manifest_from_dict,
    process_starts,
    program_engine,
    resolve,
)
from polyfhe.program.engines import (
    ENGINES as REGISTRY,
)
from polyfhe.program.errors import ProgramError

ENGINES = engine_names()
KIND_PARTS = ("client_files", "key_folders", "engine", "params_text", "card", "wrong_parameters", "client")
RECORD_PARTS = ("layouts", "available", "prepare", "client", "server", "composes_rotations", "cost")


def _ckks_program(engine: str, folder: Path) -> Path:
    """A tiny CKKS program exported for ``engine`` (skipped where the engine is not installed)."""
    from ckks_testlib import export_square_mlp

    try:
        get_backend(engine).available()
    except BackendUnavailable as exc:
        pytest.skip(f"engine {engine} is not installed here: {exc}")
    program = export_square_mlp(4, 2, calibration_samples=16, backend=engine)
    program.save(folder)
    return folder


def _concrete_program(engine: str, folder: Path) -> Path:
    """A Concrete program folder with stand-in artefacts: its format needs no Concrete ML to be recognised."""
    from polyfhe.engines.concrete.program import ConcreteProgram

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("client.zip", "server.zip", "model.onnx"):
        (folder / name).write_bytes(name.encode() * 10)
    program = ConcreteProgram.create(folder, (1, 1, 8, 8), 10, {"n_bits": 4, "rounding_threshold_bits": 6,
                                                                "p_error": None}, "post-training",
                                     {"concrete_ml": "1.9.0"}, {"model_name": "fake"})
    program.save(folder)
    return folder


# a program folder of each scheme's format, made as cheaply as that scheme allows
MAKE_PROGRAM = {"ckks": _ckks_program, "concrete": _concrete_program}


@pytest.fixture(scope="module", params=ENGINES)
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    engine = request.param
    scheme = engine_facts(engine).scheme
    if scheme not in MAKE_PROGRAM:
        pytest.fail(f"engine {engine}: no test program maker for scheme {scheme!r} (add one to MAKE_PROGRAM)")
    return engine, MAKE_PROGRAM[scheme](engine, tmp_path_factory.mktemp(engine) / "program")


def test_registry_lists_every_engine_folder_once():
    assert set(BACKEND_NAMES) <= set(ENGINES) and len(set(ENGINES)) == len(ENGINES)
    assert {"seal", "lattigo", "concrete"} <= set(ENGINES)
    with pytest.raises(ValueError, match="accepted"):
        engine_facts("openfhe")


@pytest.mark.parametrize("engine", ENGINES)
def test_facts_have_their_named_parts(engine):
    facts = engine_facts(engine)
    assert isinstance(facts, EngineFacts) and facts.name == engine and facts.scheme
    assert REGISTRY[engine][1] == facts.scheme  # the registry line's scheme agrees with the folder's facts
    fmt = facts.program_format
    assert isinstance(fmt, ProgramFormat) and fmt.format
    for reference in (fmt.load, fmt.manifest, fmt.serve or fmt.load):
        assert callable(resolve(reference)), reference
    kind = resolve(facts.kind)
    for part in KIND_PARTS:
        assert hasattr(kind, part), f"{engine}'s kind lacks {part}"
    assert isinstance(kind.client_files, tuple) and isinstance(kind.key_folders, str)
    assert facts.browser_client or facts.cli_only, "the page says what it can do for every engine"


@pytest.mark.parametrize("engine", ENGINES)
def test_process_start_is_callable_and_in_the_table_prepare_process_runs(engine):
    facts = engine_facts(engine)
    if not facts.process_start:
        assert engine not in process_starts()
        return
    assert callable(resolve(facts.process_start))  # not called: it may restart this process
    assert process_starts()[engine] == facts.process_start


@pytest.mark.parametrize("engine", ENGINES)
def test_a_ckks_engine_has_a_record_with_its_parts(engine):
    facts = engine_facts(engine)
    if not facts.record:
        assert engine not in BACKEND_NAMES  # its programs carry their own client and server
        return
    assert engine in BACKEND_NAMES and facts.scheme == "ckks"
    record = get_backend(engine)
    assert isinstance(record, Backend) and record.name == engine
    names = {f.name for f in dataclasses.fields(Backend)}
    for part in RECORD_PARTS:
        assert part in names and getattr(record, part) is not None, f"{engine}'s record lacks {part}"
    assert isinstance(record.cost, CostTraits) and callable(record.client) and callable(record.server)


def test_program_format_claims_its_own_programs_only(saved):
    engine, folder = saved
    raw = json.loads((folder / "manifest.json").read_text())
    claimed = [name for name in ENGINES if engine_facts(name).program_format.claims(raw, name)]
    assert claimed == [engine]
    assert program_engine(folder) == engine
    assert program_engine(folder.parent / "nothing-here") is None


def test_program_loads_and_its_kind_agrees(saved):
    engine, folder = saved
    facts = engine_facts(engine)
    program = resolve(facts.program_format.load)(folder)
    other = load_other_format(folder)
    assert (other is None) == (facts.scheme == "ckks")
    kind = kind_of(program)
    assert kind is resolve(facts.kind) and kind.engine(program.manifest) == engine
    manifest = manifest_from_dict(json.loads(json.dumps(program.manifest.to_dict())))
    assert type(manifest) is type(program.manifest) and manifest.program_id == program.program_id
    assert kind_of(manifest) is kind
    card = kind.card(program)
    assert card["program_id"] == program.program_id and card["scheme"]
    detail, extra = kind.wrong_parameters(program, "public context")
    assert "public context" in detail and isinstance(extra, dict)
    assert isinstance(kind.params_text(program.manifest), str)
    try:
        served = load_served_program(folder)
    except ProgramError as exc:  # this machine cannot serve it (Concrete ML's environment is missing)
        assert facts.program_format.serve, f"{engine}: its plain loader read the folder, serving failed: {exc}"
        return
    assert served.program_id == program.program_id


def test_an_unclaimed_folder_gets_the_ckks_loader_s_message(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "polyfhe-other/9"}))
    assert program_engine(tmp_path) is None and load_other_format(tmp_path) is None
    with pytest.raises(ProgramError, match="unknown program format"):
        manifest_from_dict({"format": "polyfhe-other/9"})
    with pytest.raises(ProgramError, match="unknown program format"):
        load_served_program(tmp_path)
