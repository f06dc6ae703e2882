"""The bundled engines: engines/demo-{target,draft} and engines/vla-reacher, exported from models/ on first use
and again when this edgespec's export or engine contract has changed since (`edgespec demo`, the benchmarks and
the tests call these). The exporter is imported only when a folder has to be made.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from edgespec.contract import CONTRACT_VERSION, MANIFEST_FILE, file_sha256
from edgespec.policy_contract import CONTENT_HASH, HEAD_FILE, POLICY_FILE


def need_export_extra() -> None:
    """SystemExit with the install line when torch or onnx (the export extra) is missing."""
    try:
        import torch  # noqa: F401
        import onnx  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"`edgespec export` needs the export extra ({e.name} is missing): "
                         f"pip install 'edgespec[export]' (on x86 CPU machines: pip install torch==2.13.0 first)")


DEMO_ENGINES = {"demo-target": ("demo-target", "fp32"),  # engine folder -> (checkpoint, precision)
                "demo-draft": ("demo-draft", "int8")}  # int8 draft: 4x fewer bytes to stream per draft step
DEMO_RECIPE = 4  # bump when the demo engines' export changes (2: --flavor auto, weight-only int8; 3: the target
#                 carries native weights for provider cpu-native; 4: both flavours emitted by graph.py, per-layer
#                 windows in the graph): re-exported on use


def ensure_demo_engines(models: Path, engines: Path) -> tuple[Path, Path]:
    """engines/demo-{target,draft}, exported from models/ on first use (needs the export extra).
    The target is fp32; the draft is int8 (the target verifies every token, so output is unchanged)."""
    out = []
    for name, (ckpt, dtype) in DEMO_ENGINES.items():
        eng = engines / name
        old = _older_contract(eng) or _older_recipe(eng)
        if not (eng / "engine.json").is_file() or old:
            if not (models / ckpt / "config.json").is_file():
                raise FileNotFoundError(f"neither {eng} nor the checkpoint {models / ckpt} exists; run from the "
                                        f"repository root, or pass --engines/--models")
            need_export_extra()
            from edgespec.export.onnx_export import export_engine
            why = "made by an older edgespec" if old else "first run only"
            print(f"exporting {models / ckpt} -> {eng} ({dtype}, {why})", file=sys.stderr)
            m = export_engine(models / ckpt, eng, dtype=dtype, max_context=2048, force=old,
                              role="draft" if name == "demo-draft" else "target")  # the gate binds targets
            m.extra["demo_recipe"] = DEMO_RECIPE
            m.write(eng)
        out.append(eng)
    return out[0], out[1]


VLA_POLICY = "vla-reacher"  # models/vla-reacher (train_vla.py) -> engines/vla-reacher (export_policy)


def _manifest_json(engine_dir: Path) -> dict | None:
    """engine.json as a dict, or None (missing or unreadable: loading reports a broken file)."""
    path = Path(engine_dir) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _older_recipe(engine_dir: Path) -> bool:
    """True for a demo engine folder exported by an earlier demo recipe (DEMO_RECIPE)."""
    data = _manifest_json(engine_dir)
    return data is not None and (data.get("extra") or {}).get("demo_recipe") != DEMO_RECIPE


def _older_contract(engine_dir: Path) -> bool:
    """True for an engine folder exported for an earlier engine contract (re-exported on use)."""
    data = _manifest_json(engine_dir)
    return data is not None and data.get("contract_version") != CONTRACT_VERSION


def _without_native(engine_dir: Path) -> bool:
    """True for an engine folder whose engine.json has no record of native weights: exported before the export
    wrote them (a record that says why they are unavailable counts as one)."""
    data = _manifest_json(engine_dir)
    return data is not None and "native" not in (data.get("extra") or {})


def ensure_policy_engines(models: Path, engines: Path, name: str = VLA_POLICY) -> Path:
    """engines/vla-reacher, exported from models/vla-reacher on first use (needs the export extra)."""
    eng, src = Path(engines) / name, Path(models) / name
    stale = None  # why the exported folder no longer matches the model folder or this edgespec
    if (eng / POLICY_FILE).is_file() and (src / POLICY_FILE).is_file():
        try:
            got, want = json.loads((eng / POLICY_FILE).read_text()), json.loads((src / POLICY_FILE).read_text())
        except json.JSONDecodeError:
            got, want = None, None
        if not isinstance(got, dict):
            stale = "its policy.json is not a JSON object"
        elif CONTENT_HASH not in got:
            stale = "exported before policy.json carried a content hash"
        elif isinstance(want, dict) and any(got.get(k) != v for k, v in want.items()):
            stale = "the model's policy.json changed (e.g. its state/action semantics)"
        elif (src / HEAD_FILE).is_file() and got.get("draft_head_sha256") != file_sha256(src / HEAD_FILE):
            stale = "its draft head changed"
    if _older_contract(eng / "target"):
        stale = "exported for an older engine contract"
    elif _without_native(eng / "target"):
        stale = "exported before policy targets carried native weights (provider cpu-native)"
    if not (eng / POLICY_FILE).is_file() or stale:
        if not (src / POLICY_FILE).is_file():
            raise FileNotFoundError(f"neither {eng} nor the policy model {src} exists; run from the repository "
                                    f"root, or pass --engines/--models")
        need_export_extra()
        from edgespec.export.vla import export_policy
        print(f"exporting {src} -> {eng} ({'stale: ' + stale if stale else 'first run only'})", file=sys.stderr)
        export_policy(src, eng, progress=False, force=bool(stale))
    return eng
