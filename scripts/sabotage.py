#!/usr/bin/env python3
"""Do the tests have teeth? Break the library one way at a time and check that some test fails.

    python3 scripts/sabotage.py            # every sabotage (a few minutes on 2 cores)
    python3 scripts/sabotage.py nbytes_half loader_raises
    python3 scripts/sabotage.py --fast     # one quick test per sabotage (CI runs this: tests/project/test_sabotage.py)

CI runs the fast subset (`FAST`); the whole table is for a change that touches the tests. Each sabotage is a
monkeypatch applied inside the pytest process by this same file loaded as a pytest plugin (``-p sabotage``,
selected by the ``VQ_SABOTAGE`` environment variable): no file is edited. The selected tests first run once
unsabotaged (a test failing then proves nothing and is not counted); then each sabotage runs its tests. Prints
a table of the tests each sabotage made fail, ends with ``N of M sabotages caught`` and exits 0 only when
every sabotage made at least one test fail.

Every name the sabotages touch (module paths, attributes) and every test they run is in the two tables
below, so that a renaming in the library means editing them only.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

# -- the targets: sabotage -> ["module:attribute.path", ...] ----------------------------------------------
TARGETS = {
    # install/uninstall of the packed-attention routing become no-ops: caches fall back to decoding
    "attention_off": ["veloxquant_mlx.integration.routing:install", "veloxquant_mlx.integration.routing:uninstall"],
    # the keys a cache stores are replaced by random normals of the same shape and scale
    "random_keys": ["veloxquant_mlx.cache.row_policy:Rows.append",
                    "veloxquant_mlx.compat.turboquant_cache:TurboQuantKVCache.append_key"],
    # codes built with fewer bits than asked: the codecs of the presets users run (the default's "affine_block":
    # block keys, rotated values; the budget presets' "kblock_vsym8": block keys, symmetric values), the quantizers
    # of the Lloyd-Max presets and the seed caches (the next lower width MLX packs, for the affine codecs)
    "bits_lower": ["veloxquant_mlx.codecs.affine_block:AffineBlockKeyCodec.__init__",
                   "veloxquant_mlx.codecs.affine_block_kv:AffineBlockKVCodec.__init__",
                   "veloxquant_mlx.codecs.affine:AffineRotatedCodec.__init__",
                   "veloxquant_mlx.codecs.affine_sym:AffineSymValueCodec.__init__",
                   "veloxquant_mlx.quant.turboquant_mse:TurboQuantMSE.__init__",
                   "veloxquant_mlx.quant.turboquant_rvq:TurboQuantRVQ.__init__"],
    # the model loader raises
    "loader_raises": ["veloxquant_mlx.apps.models.loader:load_model"],
    # nbytes reports half of what is stored
    "nbytes_half": ["veloxquant_mlx.cache.row_policy:Rows.nbytes"],
    # the server's request checks pass everything through
    "server_checks_off": ["veloxquant_mlx.apps.server:check_request"],
}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # mx.quantize's bit-widths: "one lower" for the affine codecs

# -- the tests each sabotage runs (pytest node ids or files), each run well under two minutes --------------
TESTS = {
    "attention_off": ["tests/apps/cli/test_run.py::test_generate_streams_answer",
                      "tests/apps/eval/test_perplexity.py::test_lockstep_registered_specs_on_tiny_model",
                      "tests/integration/test_routing.py", "tests/integration/test_enabling.py",
                      "tests/codecs/test_contract.py::test_a_new_layout_runs_a_model_from_its_codes"],
    "random_keys": ["tests/integration/test_builder.py::test_caches_run_in_a_model_of_each_family",
                    "tests/integration/test_builder_mlx_lm_paths.py::test_8bit_greedy_tokens_equal_plain_cache",
                    "tests/compat/test_turboquant_cache.py"],
    "bits_lower": ["tests/compat/test_turboquant_cache.py",
                   "tests/integration/test_builder.py::test_caches_run_in_a_model_of_each_family",
                   "tests/apps/eval/test_perplexity.py::test_lockstep_registered_specs_on_tiny_model",
                   "tests/apps/cli/test_measure.py::test_presets_lists_measured_bytes",
                   "tests/cache/test_presets_budgets.py"],
    "loader_raises": ["tests/apps/models/test_loader.py", "tests/apps/cli/test_run.py::test_generate_streams_answer"],
    "nbytes_half": ["tests/integration/test_builder_mlx_lm_paths.py::test_nbytes_is_the_sum_of_stored_arrays",
                    "tests/apps/eval/test_perplexity.py::test_lockstep_registered_specs_on_tiny_model",
                    "tests/cache/test_packed_cache.py"],
    "server_checks_off": ["tests/apps/test_server.py", "tests/apps/test_server_requests.py"],
}
# The fast subset (`--fast`, run by CI through tests/project/test_sabotage.py): one quick test per sabotage that
# catches it, so that a change making the tests blind to one of these breaks CI, not only this script.
FAST = {
    "attention_off": ["tests/integration/test_routing.py::test_protocol_cache_routed_inside_original_back_outside"],
    "random_keys": [
        "tests/integration/test_builder_mlx_lm_paths.py::test_8bit_greedy_tokens_equal_plain_cache[1-float32-llama]"],
    "bits_lower": [  # one preset: its bits fall below its code width at once
        "tests/cache/test_presets_budgets.py::test_budget_names_hold_at_every_length_from_512_tokens[tq-4b]"],
    "loader_raises": ["tests/apps/models/test_loader.py::test_bad_model_argument"],
    "nbytes_half": ["tests/integration/test_builder_mlx_lm_paths.py::test_nbytes_is_the_sum_of_stored_arrays"],
    "server_checks_off": ["tests/apps/test_server_requests.py"],
}
ENV = "VQ_SABOTAGE"
NOT_APPLIED = "SABOTAGE NOT APPLIED"  # printed by the plugin when a target is missing (renamed?)
TIMEOUT_S = 600


# ============================================================================ the plugin (inside pytest)
def _resolve(target):
    """``"pkg.mod:Cls.attr"`` -> (owner object, attribute name, original value as stored on the owner)."""
    import importlib

    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    return owner, name, original


def _replace_everywhere(owner, name, original, new):
    """Set ``owner.name = new``; for a module function also every ``veloxquant_mlx`` module alias of it."""
    setattr(owner, name, new)
    if isinstance(owner, type):
        return
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("veloxquant_mlx"):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, new)


def _lower_bits(bits):
    return max(1, bits - 1)


def _lower_affine_bits(bits):
    lower = [b for b in AFFINE_BITS if b < bits]
    return lower[-1] if lower else bits


def _random_like(x):
    import mlx.core as mx
    import numpy as np

    if isinstance(x, mx.array):
        xf = x.astype(mx.float32)
        return (mx.random.normal(x.shape) * mx.sqrt(mx.mean(xf * xf))).astype(x.dtype)
    if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating):
        return (np.random.standard_normal(x.shape) * np.sqrt(np.mean(x.astype(np.float64) ** 2))).astype(x.dtype)
    return x  # not a tensor: let the library's own checks answer


def _make(kind, target, original):
    """The sabotaged replacement of one target."""
    name = target.split(".")[-1]
    if kind == "attention_off":
        return lambda *args, **kwargs: None
    if kind == "random_keys":
        def random_keys(self, keys, *rest, **kwargs):
            return original(self, _random_like(keys), *rest, **kwargs)
        return random_keys
    if kind == "bits_lower":
        lower = _lower_affine_bits if "Affine" in target else _lower_bits

        def init(self, d, bits, *rest, **kwargs):
            return original(self, d, lower(bits) if isinstance(bits, int) and not isinstance(bits, bool) else bits,
                            *rest, **kwargs)
        return init
    if kind == "loader_raises":
        def load_model(*args, **kwargs):
            raise RuntimeError("sabotage: the model loader raises")
        return load_model
    if kind == "nbytes_half":
        return property(lambda self: original.fget(self) // 2)
    if kind == "server_checks_off":
        return lambda body, *args, **kwargs: body
    raise ValueError(f"no sabotage {kind!r} for {name}")


def pytest_configure(config):
    """Apply the sabotage named by $VQ_SABOTAGE (after the conftest files, before any test module)."""
    kind = os.environ.get(ENV)
    if not kind:
        return
    if kind not in TARGETS:
        raise ValueError(f"{ENV} must be one of {sorted(TARGETS)}, got {kind!r}")
    for target in TARGETS[kind]:
        try:
            owner, name, original = _resolve(target)
        except (ImportError, AttributeError, KeyError, ValueError) as e:
            # a missing target must not read as "caught": the runner looks for this line
            raise RuntimeError(f"{NOT_APPLIED}: {target}: {type(e).__name__}: {e}") from None
        _replace_everywhere(owner, name, original, _make(kind, target, original))


# ============================================================================ the runner (outside pytest)
_LINE = re.compile(r"^(FAILED|ERROR) (\S+)")


def run_pytest(tests, sabotage=None):
    """(failed node ids, summary line, seconds) of one pytest run of ``tests``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "scripts"), env.get("PYTHONPATH", "")])
    env.pop(ENV, None)
    if sabotage:
        env[ENV] = sabotage
    # -n 0: one process, the one the sabotage plugin patches (pyproject's addopts spread tests over workers)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-n", "0", "-p", "no:cacheprovider", "-p", "sabotage", *tests]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return set(), f"timed out after {TIMEOUT_S} s (proves nothing)", time.time() - t0
    if NOT_APPLIED in out:
        line = next(l for l in out.splitlines() if NOT_APPLIED in l)
        return set(), line[line.index(NOT_APPLIED):], time.time() - t0
    failed = {m.group(2) for m in map(_LINE.match, out.splitlines()) if m}
    lines = [l for l in out.strip().splitlines() if l.strip()]
    summary = lines[-1] if lines else "(no output)"
    if proc.returncode not in (0, 1) and not failed:  # usage error, a missing file, nothing collected:
        summary = f"pytest exit {proc.returncode} (not a test failure): {summary}"  # proves nothing
    return failed, summary, time.time() - t0


def main(argv):
    fast = "--fast" in argv
    argv = [a for a in argv if a != "--fast"]
    tests = FAST if fast else TESTS
    chosen = argv or list(TARGETS)
    unknown = [k for k in chosen if k not in TARGETS]
    if unknown:
        print(f"unknown sabotage(s) {unknown}; choose from {sorted(TARGETS)}", file=sys.stderr)
        return 2
    union = sorted({t for k in chosen for t in tests[k]})
    base_failed, base_summary, secs = run_pytest(union)
    print(f"baseline (no sabotage), {len(union)} selections: {base_summary} [{secs:.0f} s]")
    for t in sorted(base_failed):
        print(f"  fails without sabotage (not counted): {t}")
    rows, caught = [], 0
    for kind in chosen:
        failed, summary, secs = run_pytest(tests[kind], kind)
        new = sorted(failed - base_failed)
        caught += bool(new)
        rows.append((kind, "yes" if new else "NO", len(new), summary, secs, new))
    print()
    print(f"| {'sabotage':<18} | caught | failing tests | {'pytest summary':<40} | time |")
    print(f"|{'-' * 20}|--------|---------------|{'-' * 42}|------|")
    for kind, ok, n, summary, secs, _ in rows:
        print(f"| {kind:<18} | {ok:<6} | {n:>13} | {summary[:40]:<40} | {secs:3.0f} s |")
    for kind, _, _, _, _, new in rows:
        print(f"\n{kind}: targets {', '.join(TARGETS[kind])}")
        for t in new[:12]:
            print(f"  FAILED {t}")
        if len(new) > 12:
            print(f"  ... and {len(new) - 12} more")
        if not new:
            print("  no test failed: NOT CAUGHT")
    print(f"\n{caught} of {len(chosen)} sabotages caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
