"""Rerun the deterministic figures the README quotes and compare them, field by field, with the committed results.

Greedy generation is deterministic on one machine (batch-invariant steps on a CPU, docs/numerics.md). On a CPU with
the recorded run's vector extensions, caches and core count (:func:`same_kernels`), tau, rounds, the
all-drafts-survive rate and the equality with AR of a rerun at HEAD must equal what the committed JSON records,
exactly. Elsewhere XLA's kernels sum in other orders and bf16 rounds apart, so a greedy token can flip: there the
figures the README quotes (tau and rounds) must lie within :data:`OTHER_CPU_TOLERANCE` of the recorded ones, and
every output must still equal AR's. Times and speedups depend on the machine and its load and are not compared. A
result drifts when the code changes what it computes: rerun the command it records and commit the new JSON with
the text that quotes it (``--tables`` prints the README's table from the JSON, so the text is not typed by hand).

    python -m experiments.results_check                 # rerun and compare (minutes; `make results-check`)
    python -m experiments.results_check --tables        # the README's zoo table from results/compare_zoo_cpu.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ready_jax import cli, provenance, repository

from .common import shown

COMPARE_ZOO = Path("results") / "compare_zoo_cpu.json"
# The settings of compare_zoo that decide its deterministic figures (the rest only times them).
RERUN_SETTINGS = ("zoo", "prompts", "batch1_prompts", "prompt_tokens", "max_new_tokens", "seed", "dtype")
DETERMINISTIC = ("tau", "tau_by_kind", "rounds", "all_drafts_survive", "identical_to_ar")
# On another CPU: the relative drift allowed in the quoted figures, and the fields compared (docs/numerics.md).
OTHER_CPU_TOLERANCE = 0.05
QUOTED = ("tau", "rounds", "identical_to_ar")


def rerun_command(recorded: dict, out: str) -> list[str]:
    """The compare_zoo command that reproduces ``recorded``'s deterministic figures, writing to ``out``."""
    settings = recorded["settings"]
    flags = [f"--{name.replace('_', '-')}={settings[name]}" for name in RERUN_SETTINGS]
    return [sys.executable, "-m", f"{__package__}.compare_zoo", *flags, "--repeats=1", f"--out={out}"]


def _agrees(old, new, tolerance: float) -> bool:
    if tolerance and isinstance(old, int | float) and not isinstance(old, bool) and isinstance(new, int | float):
        return abs(new - old) <= tolerance * abs(old)
    return old == new


def rerun_environment(recorded: dict) -> dict:
    """This process's environment with ``XLA_FLAGS`` as the recorded run had them: the flags change XLA's code
    (an optimisation level, say), and with it the rounding of a bf16 result, so a rerun from a shell or a test
    harness that sets its own flags would otherwise compute other figures."""
    return dict(os.environ, XLA_FLAGS=recorded["settings"]["runtime"]["xla_flags"])


def differences(recorded: dict, rerun: dict, tolerance: float = 0.0) -> list[str]:
    """Every deterministic field of every method (batch 16, and batch 1 where both have it) that differs: exactly,
    or with ``tolerance`` > 0 the quoted fields by more than that relative drift."""
    found = []
    fields16 = QUOTED if tolerance else DETERMINISTIC
    for section, fields in (("results", fields16), ("batch1", ("tau", "identical_to_ar"))):
        old, new = recorded.get(section, {}), rerun.get(section, {})
        for method in sorted(set(old) | set(new)):
            if method not in old or method not in new:
                found.append(f"{section}.{method}: {'only in the rerun' if method in new else 'missing in the rerun'}")
                continue
            found += [f"{section}.{method}.{field}: recorded {old[method].get(field)!r}, now {new[method].get(field)!r}"
                      for field in fields if not _agrees(old[method].get(field), new[method].get(field), tolerance)]
    return found


def same_kernels(recorded: dict) -> bool:
    """Whether this machine's CPU has the vector extensions, caches and cores the recorded run's had: XLA's CPU
    kernels follow the extensions, Eigen's matmul blocks the caches and its threads the cores, and so the last bits
    of a bf16 result follow all three."""
    here, there = provenance.cpu(), recorded.get("environment", {})
    return all(there.get(key) == here[key] for key in ("cpu_isa", "cpu_caches", "cpu_cores"))


def readme_table(recorded: dict) -> str:
    """The README's zoo table: tau and speedup at batch 16 per drafter, as the JSON records them."""
    rows = ["| arm | tau | rounds | speedup vs AR |", "|---|---|---|---|"]
    for method, r in recorded["results"].items():
        if method != "autoregressive":
            rows.append(f"| {method} | {shown(r['tau'], '.2f')} | {r['rounds']} | {r['speedup']:.2f}x |")
    return "\n".join(rows)


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.results_check", __doc__)
    parser.add_argument("--tables", action="store_true", help="print the README's table from the JSON and stop")
    args = parser.parse_args(argv)
    path = Path(repository.root()) / COMPARE_ZOO
    recorded = json.loads(path.read_text())
    if args.tables:
        print(readme_table(recorded))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rerun.json")
        done = subprocess.run(rerun_command(recorded, out), cwd=repository.root(), env=rerun_environment(recorded))
        if done.returncode:
            raise SystemExit(f"the rerun of {COMPARE_ZOO} failed (exit status {done.returncode})")
        exact = same_kernels(recorded)
        found = differences(recorded, json.loads(Path(out).read_text()), 0.0 if exact else OTHER_CPU_TOLERANCE)
    how = "exactly" if exact else (f"within {OTHER_CPU_TOLERANCE:.0%} (tau, rounds; outputs equal to AR), the "
                                   "recorded run's CPU having other vector extensions, caches or cores")
    if found:
        raise SystemExit(f"{COMPARE_ZOO} drifted from HEAD in {len(found)} field(s), compared {how}:\n  "
                         + "\n  ".join(found))
    print(f"{COMPARE_ZOO}: every deterministic figure reproduced at HEAD, {how}")


if __name__ == "__main__":
    main()
