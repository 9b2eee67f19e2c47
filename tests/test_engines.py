"""Every shipped accelerate config, launched with its engine: exact accumulation and the fused loss, on 2 processes.

One launch per config (each costs 15-30 s of start-up); tests/engine_check.py runs that engine's cases and writes
the measured errors, asserted here. On this project's machines the processes are CPU processes talking over gloo:
DeepSpeed runs its CPU accelerator, FSDP2 is applied with torch's ``fully_shard`` through hfacc's loop helper (the
Trainer path needs GPUs, see the skip reason below). accelerate_configs/ddp.yaml is launched by
tests/test_distributed.py. benchmarks/engines.py runs the same checks on GPUs in bf16.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.distributed

GRAD_TOL = 1e-6  # relative L2 error of the applied gradient against one big batch: fp32 rounding
LOSS_TOL = 1e-5  # relative error of the logged loss against the big batch's token mean
TIMEOUT = 420
GPUS = torch.cuda.device_count()


def launch_command(config, engine, out, *options, processes=2):
    """``accelerate launch`` of the shipped config, in fp32 (the configs for big models say bf16)."""
    config = f"accelerate_configs/{config}.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--mixed_precision", "no"]
    return [*command, "--num_processes", str(processes), *options, "tests/engine_check.py", engine, str(out)]


def run_check(tmp_path_factory, config, engine, processes=2):
    out = tmp_path_factory.mktemp(engine) / "results.json"
    port = ["--main_process_port", str(free_port())] if processes > 1 else []
    proc = subprocess.run(
        launch_command(config, engine, out, *port, processes=processes),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def assert_exact(case, fused=True):
    assert case["grad_error"] <= GRAD_TOL
    assert case["loss_error"] <= LOSS_TOL
    assert case["fused"] is fused
    if fused:  # in every training micro-batch the head returned the loss sum: no [B, T, V] logits
        assert case["head"]["forwards"] > 0 and case["head"]["in_forward"][0]["output_dim"] == 0


# ---- single device and multi-node DDP ---------------------------------------------------------------------------


def test_single_device_config(tmp_path_factory):
    results = run_check(tmp_path_factory, "single_device", "single", processes=1)
    assert results["world_size"] == 1
    case = results["cases"]["trainer bs2 ga4 fused"]
    assert case["distributed_type"] == "DistributedType.NO" and case["steps"] == 1
    assert_exact(case)


def test_multi_node_config_as_two_machines_of_one_process(tmp_path_factory):
    """multi_node_ddp.yaml started as it is on two machines, both on this host: machine ranks 0 and 1."""
    out = tmp_path_factory.mktemp("multi_node") / "results.json"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            launch_command(
                "multi_node_ddp",
                "ddp",
                out,
                *("--num_machines", "2", "--machine_rank", str(rank)),
                *("--main_process_ip", "127.0.0.1", "--main_process_port", port),
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-6000:]
    results = json.loads(out.read_text())
    # (global rank, machine rank, local rank) of each process: one process on each of two machines.
    assert results["ranks"] == [[0, 0, 0], [1, 1, 0]]
    case = results["cases"]["trainer bs1 ga4 fused"]
    assert case["world_size"] == 2 and case["distributed_type"].endswith(("MULTI_CPU", "MULTI_GPU"))
    assert_exact(case)


# ---- FSDP2 ------------------------------------------------------------------------------------------------------

FSDP2_LOOP_CASES = [
    "loop full-shard fused",
    "loop shard-grad-op fused",
    "loop full-shard fused tied",
    "loop full-shard fused head-unit",
]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return run_check(tmp_path_factory, "fsdp2", "fsdp2")


@pytest.mark.parametrize("case", FSDP2_LOOP_CASES)
def test_fsdp2_through_the_loop_helper_is_exact_with_the_fused_loss(fsdp2, case):
    assert fsdp2["world_size"] == 2
    assert_exact(fsdp2["cases"][case])


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_a_vllm_engine_gets_the_whole_weights_of_a_sharded_policy(request, engine):
    """The weights a colocated vLLM engine is given (hfacc.generation.vllm_engine.get_engine_weights): gathered from
    ZeRO-3's partitions and FSDP2's shards, every name and shape of the architecture, the values exactly."""
    results = request.getfixturevalue(engine)
    cases = {n: c for n, c in results["cases"].items() if "engine_weights" in c and ("loop" in n or engine == "zero3")}
    assert len(cases) >= 2, sorted(results["cases"])
    for name, case in cases.items():
        assert case["engine_weights"]["error"] == 0 and case["engine_weights"]["tensors"] >= 11, name


def test_fsdp2_fused_and_plain_paths_agree(fsdp2):
    assert_exact(fsdp2["cases"]["loop full-shard plain"], fused=False)
    assert fsdp2["fused_vs_plain"] <= GRAD_TOL


@pytest.mark.parametrize("case", ["loop full-shard fused", "loop full-shard fused head-unit"])
def test_fsdp2_fused_head_computes_on_the_gathered_weight(fsdp2, case):
    """Outside the forward each rank holds half of the [96, 64] weight; inside the head's forward, the whole of it
    (the root's all-gather, or the head's own when it is a separate FSDP unit)."""
    head = fsdp2["cases"][case]["head"]
    assert head["outside"] == {"type": "DTensor", "shape": [96, 64], "local_numel": 96 * 64 // 2}
    assert head["in_forward"][0]["weight"] == {"type": "Parameter", "shape": [96, 64], "local_numel": 96 * 64}


@pytest.mark.skipif(GPUS >= 2, reason="on GPUs accelerate applies FSDP2 itself")
def test_fsdp2_config_on_cpu_processes_trains_as_ddp_and_says_so(fsdp2):
    case = fsdp2["cases"]["trainer on cpu (ddp)"]
    assert case["distributed_type"] == "DistributedType.MULTI_CPU" and not case["fsdp_enabled"]
    assert_exact(case)
    assert len(fsdp2["warnings"]) == 2 and all("train as plain data parallel (DDP)" in w for w in fsdp2["warnings"])


@pytest.mark.skipif(
    GPUS < 2,
    reason="needs 2 GPUs: accelerate turns FSDP on only for GPU-like distributed types (AcceleratorState: "
    "MULTI_GPU/XPU/NPU/...); CPU processes (MULTI_CPU, gloo) get DDP instead, so TokenWeightedTrainer cannot run "
    "FSDP2 here. The same engine runs above through accumulation_window with fully_shard applied directly; "
    "benchmarks/engines.py runs this Trainer path on GPUs.",
)
@pytest.mark.parametrize(
    "case",
    ["trainer bs1 ga4 fused", "trainer bs1 ga4 fused tied", "trainer bs1 ga4 fused shard-grad-op"],
)
def test_fsdp2_trainer_path(fsdp2, case):
    result = fsdp2["cases"][case]
    assert result["distributed_type"] == "DistributedType.FSDP" and result["fsdp_enabled"]
    assert_exact(result)


# ---- DeepSpeed ZeRO-2 and ZeRO-3 (CPU accelerator, gloo) --------------------------------------------------------


def deepspeed_check(tmp_path_factory, stage):
    pytest.importorskip("deepspeed", reason="pip install deepspeed (it runs on CPU processes, over gloo)")
    return run_check(tmp_path_factory, f"deepspeed_zero{stage}", f"zero{stage}")


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return deepspeed_check(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return deepspeed_check(tmp_path_factory, 3)


@pytest.fixture(params=[2, 3], ids=["zero2", "zero3"])
def zero(request):
    return request.getfixturevalue(f"zero{request.param}")


def test_deepspeed_trainer_is_exact_with_the_fused_loss(zero):
    assert zero["world_size"] == 2
    for name, case in zero["cases"].items():
        assert case["distributed_type"] == "DistributedType.DEEPSPEED" and case["steps"] == 1, name
        assert_exact(case, fused="plain" not in name)
    assert zero["fused_vs_plain"] <= GRAD_TOL
    # evaluate() before train(), as the jobs do (ZeRO-2: stock has no engine for it; ZeRO-3: stock's inference engine
    # left train() without one): a held-out loss, then the exact update
    assert zero["cases"]["trainer bs1 ga4 plain"]["evaluated_first"] > 0


def test_zero3_fused_head_computes_on_the_gathered_weight(zero3):
    """ZeRO-3 partitions the output projection (an empty local tensor outside the forward); its own hooks gather it
    around the head's forward, where the fused loss runs, with and without tied embeddings."""
    assert set(zero3["cases"]) >= {"trainer bs1 ga4 fused", "trainer bs1 ga4 fused tied"}
    for name in ("trainer bs1 ga4 fused", "trainer bs1 ga4 fused tied"):
        head = zero3["cases"][name]["head"]
        assert head["outside"]["local_numel"] == 0 and head["outside"]["ds_status"].endswith("NOT_AVAILABLE")
        seen = head["in_forward"][0]["weight"]
        assert seen["shape"] == [96, 64] and seen["ds_status"].endswith(".AVAILABLE")


def test_deepspeed_skips_nan_and_empty_windows_without_touching_the_weights(zero):
    """Windows: clean, NaN in rank 1's second micro-batch, no targets anywhere, clean (SGD with weight decay, so
    even a zero gradient would move the weights)."""
    r = zero["nonfinite"]
    assert r["steps"] == 4 and r["skipped_steps"] == 1 and r["empty_windows"] == 1
    assert r["unchanged_by_nan_window"] and r["unchanged_by_empty_window"] and r["all_finite"]
    assert r["changed_by_last_window"]
    assert "step 2 skipped: non-finite loss in micro-batch(es) [1] of 2 on rank 1" in "\n".join(r["warnings"])


def test_deepspeed_without_its_overflow_check_is_refused(zero2):
    assert "zero_optimization.compute_grad_norm: true" in zero2["overflow_check_off"]
    assert "skip_nonfinite_steps=False" in zero2["overflow_check_off"]


# ---- preference pairs (DPO): the reference sharded like the policy --------------------------------------------


@pytest.mark.parametrize("case", ["fsdp2 loop copy", "fsdp2 loop given"])
def test_fsdp2_preference_reference_is_sharded_like_the_policy(fsdp2, case):
    """tests/preference_check.py: the frozen copy (or the given model) is fully_shard-ed on the policy's units and
    mesh (half of the [96, 32] head on each rank), and the DPO update with the NLL term is the big batch's."""
    r = fsdp2["preference"][case]
    assert r["grad_error"] <= GRAD_TOL and r["fused"] and r["reference_fused"]
    assert r["reference_sharded"] and r["reference_head_numel"] == 96 * 32
    assert r["reference_head_local_numel"] == 96 * 32 // 2


@pytest.mark.parametrize("case", ["dpo copy", "dpo given"])
def test_zero3_preference_reference_is_partitioned_like_the_policy(zero3, case):
    r = zero3["preference"][case]
    assert r["world_size"] == 2 and r["grad_error"] <= GRAD_TOL and r["loss_error"] <= LOSS_TOL and r["fused"]
    # Each rank holds its partition of the reference (about half), as of the policy: never a second whole model.
    assert r["reference_partitioned"] and r["reference_fused"]
    assert r["reference_partition_numel"] <= r["reference_numel"] // 2 + 64


# ---- distillation: the teacher sharded like the student ---------------------------------------------------------


def test_fsdp2_distillation_teacher_is_sharded_like_the_student(fsdp2):
    """tests/distillation_check.py: a teacher of another architecture (2 layers, hidden 48), fully_shard-ed by hfacc
    on its decoder layers and root with the student's mesh (half of its [64, 48] head on each rank); the update with
    beta 0.5, temperature 2 and the CE term is the big batch's, both models' logits chunked."""
    r = fsdp2["distillation"]
    assert r["grad_error"] <= GRAD_TOL and r["fused"] and r["teacher_fused"]
    assert r["teacher_sharded"] and r["teacher_layers_sharded"] == 2
    assert r["teacher_head_numel"] == 64 * 48 and r["teacher_head_local_numel"] == 64 * 48 // 2


def test_zero3_distillation_teacher_is_partitioned_like_the_student(zero3):
    r = zero3["distillation"]["distill teacher"]
    assert r["world_size"] == 2 and r["grad_error"] <= GRAD_TOL and r["loss_error"] <= LOSS_TOL
    assert r["fused"] and r["teacher_fused"] and r["teacher_partitioned"] and r["padding_free"]
    assert r["teacher_partition_numel"] <= r["teacher_numel"] // 2 + 64


def test_the_sft_job_runs_under_zero3_as_shipped(tmp_path):
    """`accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/sft.py` (fp32, 2 CPU ranks):
    the job evaluates before training (stock's ZeRO-3 inference engine left train() none to step with), trains, and
    answers its held-out prompts on every rank together (ZeRO-3 gathers each layer from every rank; the main
    process answering alone lost its peer). Both stopped the job with a traceback before."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/deepspeed_zero3.yaml",
    ]
    command += ["--mixed_precision", "no", "--num_processes", "2", "--main_process_port", str(free_port())]
    command += ["recipes/sft.py", "--max_steps", "2", "--num_embedded_examples", "64", "--output_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "eval   before training loss" in proc.stdout and "exact match          0." in proc.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["world_size"] == 2 and 0.0 <= metrics["exact_match"] <= 1.0
