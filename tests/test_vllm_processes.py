"""vLLM in processes of their own: two training processes, each with its own colocated engine, train exactly; and
``hfacc grpo --use_vllm true`` runs as the README says (the job: a short SFT, then GRPO sampled on vLLM, the held-out
prompts answered by the same engine).

Runs in the vLLM environment (README "Generation on vLLM", .ci/run); elsewhere it is skipped.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfacc.generation.vllm_engine import is_vllm_available
from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.skipif(
    not is_vllm_available(),
    reason="vLLM is not installed here: the vLLM tests run in the vLLM environment (README 'Generation on vLLM')",
)


@pytest.mark.distributed
def test_two_processes_each_with_its_own_engine_train_exactly(tmp_path):
    out = tmp_path / "results.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "tests/vllm_check.py", str(out)]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["world_size"] == 2 and results["engine"] == "vllm" and results["syncs"] == 1
    assert len(results["logp_difference_max"]) == 2 and max(results["logp_difference_max"]) <= 1e-3
    for step in results["steps"]:  # the second after both engines got the first step's weights
        assert step["rows_per_rank"] == [8, 8] and step["prompts_differ"] and step["weighted"]
        assert step["reference_norm"] > 0 and step["grad_error"] <= 1e-6, step


@pytest.mark.slow
def test_hfacc_grpo_use_vllm_true_runs_as_the_readme_says(tmp_path):
    """The README's command, shortened (a 2-step SFT of a model whose heads vLLM's CPU kernels take, 2 GRPO steps)."""
    hfacc = shutil.which("hfacc", path=str(Path(sys.executable).parent))
    command = [hfacc] if hfacc else [sys.executable, "-m", "hfacc.cli"]
    out = tmp_path / "grpo"
    command += ["grpo", "--use_vllm", "true", "--max_steps", "2", "--num_train_prompts", "32"]
    command += ["--num_eval_prompts", "4", "--per_device_train_batch_size", "8", "--num_generations", "4"]
    command += ["--sft_output_dir", str(tmp_path / "none"), "--sft_max_steps", "2", "--sft_num_examples", "160"]
    command += ["--embedded_hidden_size", "128", "--embedded_num_layers", "1", "--max_completion_length", "16"]
    command += ["--logging_steps", "1", "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "sampled with vLLM" in proc.stdout and "=== hfacc GRPO summary ===" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and "exact_match" in metrics["before"] and "exact_match" in metrics["after"]
    assert (out / "model.safetensors").is_file()
