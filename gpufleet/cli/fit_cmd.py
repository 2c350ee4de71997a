"""`gpufleet fit`: will this model fit here? vLLM's start-up arithmetic on live numbers."""
from __future__ import annotations

from typing import Optional

import click

from gpufleet.cli import AppContext, cli, selection_options
from gpufleet.cli.output import snapshot_warnings, warn
from gpufleet.core.fit import DEFAULT_UTIL, fit_report, need_from_options, parse_gpus
from gpufleet.render.common import to_json
from gpufleet.render.fit import render_text


@cli.command()
@selection_options
@click.option("--gpus", "gpus_spec", default="all", show_default=True, help="GPUs: 0-3, 0,2,5 or all.")
@click.option("--weights-gib", type=float, default=None, help="Model weights in GiB (whole model); or --params, not both.")
@click.option("--params", default=None, help="Parameter count: 14e9, 14B, 7b (with --dtype; fp16 when not given).")
@click.option("--dtype", default=None, help="fp32, fp16, bf16, fp8, int8, int4, fp4 (with --params).")
@click.option("--activations-gib", type=float, default=0.0, show_default=True,
              help="Peak activation memory per GPU (vLLM's non-KV memory minus weights).")
@click.option("--non-torch-gib", type=float, default=0.0, show_default=True,
              help="Non-torch memory growth after vLLM's snapshot (cuBLAS, late NCCL buffers).")
@click.option("--util", type=float, default=DEFAULT_UTIL, show_default=True, help="gpu_memory_utilization.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size: weights split evenly.")
@click.option("--context-mib", type=float, default=None,
              help="CUDA context taken from the free memory the host reports (default: measured, see docs).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document.")
@click.pass_obj
def fit(app: AppContext, hosts, groups, tags, all_, gpus_spec: str, weights_gib: Optional[float],
        params: Optional[str], dtype: Optional[str], activations_gib: float, non_torch_gib: float,
        util: float, tp: int, context_mib: Optional[float], as_json: bool) -> int:
    """Will this model fit on the selected GPUs? Exit 0 fits everywhere, 1 not somewhere, 2 usage.

    One row per GPU (a host that cannot be checked: one row saying why, e.g. fewer GPUs than
    --tp). KV CACHE is the GiB vLLM would give the KV cache at --util; in parentheses when
    START-UP is FAIL: what vLLM would compute had start-up not stopped first (negative: not
    even the weights fit). MAX UTIL / MIN UTIL bound the --util that starts and leaves a KV
    cache. --params without --dtype assumes fp16 (said under the table).

    Exit 1 also for a host that cannot be checked; exit 2 for bad options, --weights-gib with
    --params, or --gpus naming a GPU a selected host does not have (as clean: a command line
    that names GPUs a host lacks is wrong, whatever the command).
    """
    from gpufleet.cli.progress import HostProgress
    from gpufleet.ops.collect import snapshot_hosts

    gpus = parse_gpus(gpus_spec)
    need = need_from_options(weights_gib=weights_gib, params=params, dtype=dtype,
                             activations_gib=activations_gib, non_torch_gib=non_torch_gib, tp=tp)
    selected = app.select(hosts, groups, tags, all_)
    with HostProgress(selected, "fit") as progress:  # stderr, on a terminal only
        results = snapshot_hosts(selected, forks=app.forks, **progress.callbacks())
    report = fit_report(results, need, util=util, context_mib=context_mib, gpus=gpus)
    click.echo(to_json(report.document) if as_json else render_text(report))
    warn(snapshot_warnings(results, selected))  # stderr: the rows above stay the rows
    return report.exit_code
