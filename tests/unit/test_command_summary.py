"""render.command.command_summary: what a process runs, in words an operator recognises,
safe to print, cut to a width (pure; the command lines are the shapes GPU hosts run)."""
from __future__ import annotations

import pytest

from gpufleet.render.command import command_summary


@pytest.mark.parametrize("cmdline,comm,shown", [
    # a script instead of its interpreter; paths cut to their last part
    ("python3 train_dflash.py --epochs 3", "python3", "train_dflash.py --epochs 3"),
    ("/usr/bin/python3 -u /data/alice/proj/train_dflash.py --config /data/alice/cfg.yaml",
     "python3", "train_dflash.py --config cfg.yaml"),
    ("python3.11 -X dev -W ignore script.py a b", "python3.11", "script.py a b"),
    ("/opt/conda/bin/python -B ./tools/eval.py", "python", "eval.py"),
    # a module, with -m kept so it reads as one
    ("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --tp 8", "python",
     "-m sglang.launch_server --model-path Qwen/Qwen3-8B --tp 8"),
    ("python3 -c import torch; torch.cuda.init()", "python3",
     "python3 -c import torch; torch.cuda.init()"),
    # console scripts: the interpreter runs the script, comm is the script's name
    ("/usr/bin/python3 /usr/local/bin/vllm serve /models/Qwen/Qwen3-235B --tp 8", "vllm",
     "vllm serve Qwen3-235B --tp 8"),
    ("vllm serve MODEL --tp 8", "vllm", "vllm serve MODEL --tp 8"),
    ("/usr/local/bin/ollama serve", "ollama", "ollama serve"),
    # launchers: the script they start, not their own options
    ("/usr/bin/python3 /usr/local/bin/torchrun --nproc_per_node 8 --master_port 29500 "
     "train.py --lr 1e-4", "torchrun", "torchrun train.py --lr 1e-4"),
    ("python3 -m torch.distributed.run --nproc-per-node=8 /work/pretrain.py --bf16", "python3",
     "torchrun pretrain.py --bf16"),
    ("torchrun --standalone --nproc_per_node 4 -m mypkg.train --x 1", "torchrun",
     "torchrun -m mypkg.train --x 1"),
    ("accelerate launch --num_processes 4 finetune.py --bf16", "accelerate",
     "accelerate finetune.py --bf16"),
    ("deepspeed --num_gpus 8 ds_train.py", "deepspeed", "deepspeed ds_train.py"),
    # titles a process gave itself (vLLM's setproctitle): kept
    ("VLLM::Worker_TP0", "VLLM::Worker_TP", "VLLM::Worker_TP0"),
    ("VLLM::EngineCore_DP0", "VLLM::EngineCor", "VLLM::EngineCore_DP0"),
    ("train_dflash.py", "train_dflash.p", "train_dflash.py"),
    # a title only in comm: both, so the operator sees the title and what started it
    ("python3 -m vllm.entrypoints.openai.api_server", "VLLM::Worker_TP",
     "VLLM::Worker_TP: -m vllm.entrypoints.openai.api_server"),
    # shells: a script file, or the -c text
    ("bash -c while true; do python3 train.py; done", "bash",
     "bash -c while true; do python3 train.py; done"),
    ("/bin/sh -ec python3 serve.py", "sh", "sh -c python3 serve.py"),
    ("/bin/sh /opt/run.sh --fast", "sh", "run.sh --fast"),
    # env before the program
    ("env CUDA_VISIBLE_DEVICES=0 python3 x.py", "python3", "x.py"),
    ("/usr/bin/env -i PATH=/bin python3 -m http.server", "python3", "-m http.server"),
    ("python3 job.py --n 2", "trainer", "trainer: job.py --n 2"),  # a prctl rename
    ("python3 /tmp/hold.py trainer 5", "trainer", "hold.py trainer 5"),  # said already
    # PyTorch names its main thread: not a title
    ("python3 train.py", "pt_main_thread", "train.py"),
    ("/usr/bin/node server.js", "node", "node server.js"),
    # no command line (a kernel thread, a zombie): comm
    ("", "kworker/0:1", "kworker/0:1"),
    ("", "", "?"),
])
def test_summaries(cmdline: str, comm: str, shown: str) -> None:
    assert command_summary(cmdline, comm, width=80) == shown


def test_a_long_command_is_cut_to_the_width_and_says_so() -> None:
    text = command_summary("python3 train.py " + " ".join(f"--opt{i} {i}" for i in range(40)),
                           "python3", width=30)
    assert len(text) == 30 and text.endswith("...") and text.startswith("train.py --opt0 0")
    assert command_summary("python3 x.py", "python3", width=30) == "x.py"


@pytest.mark.parametrize("cmdline", [
    "python3 job.py \x1b[2J\x1b[31mPWNED",  # an escape sequence
    "python3 job.py\nVLLM::Worker 1 999MiB",  # a fake second line (argv split on it anyway)
    "python3 evil\u202egnp.py",  # a bidirectional override
    "python3 a\u200bb.py \x7f\x9b",  # zero width, DEL, a C1 control
])
def test_what_a_process_chose_cannot_reach_the_terminal(cmdline: str) -> None:
    text = command_summary(cmdline, "python3", width=200)
    assert text.isprintable() and "\x1b" not in text and "\n" not in text, repr(text)
    assert "\u202e" not in text and "\u200b" not in text


def test_an_escaped_character_is_shown_not_dropped() -> None:
    assert command_summary("python3 evil\u202egnp.py", "python3") == "evil\\u202egnp.py"
    assert command_summary("python3 job.py \x1b[2J", "python3") == "job.py \\x1b[2J"
