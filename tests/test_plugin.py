"""Plugin registration: cheap, idempotent, version-guarded."""

import os
import subprocess
import sys

import pytest

from tests.engines import metadata_differences
from vllm_peagle import patches


def test_register_is_cheap_and_idempotent():
    # A fresh interpreter: registering twice must not import the model runner or torch.
    code = (
        "import sys\n"
        "from vllm_peagle.plugin import register\n"
        "register(); register()\n"
        "heavy = [m for m in ('torch', 'vllm.v1.worker.gpu_model_runner') if m in sys.modules]\n"
        "hooks = [f for f in sys.meta_path if type(f).__name__ == '_PatchOnImport']\n"
        "print(heavy, len(hooks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 4"


def test_step_timings_hook_the_scheduler_only_when_asked():
    code = (
        "import sys\n"
        "from vllm_peagle.plugin import register\n"
        "register()\n"
        "print(sorted(f.module_name for f in sys.meta_path if hasattr(f, 'module_name')))\n"
    )
    env = {**os.environ, patches.STEP_TIMINGS_ENV: "/tmp/unused"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert "vllm.v1.core.sched.scheduler" in out.stdout


def test_step_timings_log_each_call_as_its_phase(tmp_path):
    class Engine:
        def step(self, value):
            return value + 1

        def sample(self):
            raise RuntimeError("failed step")

    prefix = str(tmp_path / "timings")
    patches._time_phases(Engine, {"step": "step", "sample": "sample"}, prefix=prefix)
    assert Engine().step(1) == 2 and Engine().step(2) == 3
    with pytest.raises(RuntimeError, match="failed step"):
        Engine().sample()  # timed too, and the error still propagates
    patches._phase_logs[prefix].flush()
    [log] = tmp_path.glob("timings.*")
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [phase for phase, _, _ in lines] == ["step", "step", "sample"]
    starts = [float(start) for _, start, _ in lines]
    assert starts == sorted(starts) and all(float(seconds) >= 0 for _, _, seconds in lines)


@pytest.mark.parametrize(
    ("version", "supported"),
    [("0.32.0", True), ("0.33.1", True), ("0.31.9", False), ("0.34.0", False), ("1.0", False)],
)
def test_supported_version_range(version, supported):
    assert patches.is_supported_vllm(version) is supported


def test_unsupported_version_message_names_the_range():
    message = patches.unsupported_vllm_message("0.35.0")
    assert ">=0.32,<0.34" in message and "0.35.0" in message and "Fix:" in message


def test_cpu_expand_keeps_float_values():
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    # The plugin registered in conftest; the CPU platform now installs the fixed kernel.
    current_platform.register_triton_kernel_overrides()
    temperature = torch.tensor([0.7, 0.0, 1.3])
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens(temperature, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    top_k = torch.tensor([5, 0], dtype=torch.int32)
    out = expand_batch_to_tokens(top_k, torch.tensor([1, 3], dtype=torch.int32), 3)
    assert out.dtype == torch.int32 and out.tolist() == [5, 0, 0]


@pytest.mark.parametrize(
    "num_scheduled",
    [[1], [1, 1], [1, 100, 3, 1], [37, 1, 1, 1, 1, 1, 1, 1]],
    ids=["one", "two-decodes", "prompt-chunks", "batch-8"],
)
def test_zero_draft_metadata_is_what_vllm_computes(num_scheduled):
    import types

    import numpy as np
    import torch
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    vllm_metadata = runner_cls._calc_spec_decode_metadata.__wrapped__  # unpatched original
    scratch = 512
    runner = types.SimpleNamespace(
        arange_np=np.arange(scratch, dtype=np.int64),
        _arange_scratch=np.empty(scratch, dtype=np.int64),
        input_ids=types.SimpleNamespace(gpu=torch.arange(1000, 1000 + scratch, dtype=torch.int32)),
        device=torch.device("cpu"),
    )
    runner._get_cumsum_and_arange = types.MethodType(runner_cls._get_cumsum_and_arange, runner)
    num_draft_tokens = np.zeros(len(num_scheduled), dtype=np.int32)
    cu_num_scheduled = np.cumsum(np.array(num_scheduled, dtype=np.int32), dtype=np.int32)

    expected = vllm_metadata(runner, num_draft_tokens, cu_num_scheduled)
    constants = {}
    for _ in range(2):  # the second time from the batch size's kept constants
        ours = patches.zero_draft_metadata(
            num_draft_tokens, cu_num_scheduled, runner.input_ids.gpu, constants
        )
        assert ours.max_spec_len == expected.max_spec_len == 0
        assert metadata_differences(ours, expected) == []
    assert list(constants) == [len(num_scheduled)]


def test_after_a_step_that_drafted_nothing_there_are_no_drafts_to_take():
    import types

    import torch
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    runner = types.SimpleNamespace(
        drafter=types.SimpleNamespace(peagle_enabled=True),
        num_spec_tokens=4,
        prev_num_spec_tokens=4,
        _draft_token_ids=torch.empty((3, 0), dtype=torch.int32),  # K = 0 for 3 requests
        _draft_token_req_ids=None,
        use_async_scheduling=False,
        # vLLM's own copy would need these: CPU buffers and events it has no use for here.
        draft_token_ids_cpu=None,
        draft_token_ids_event=None,
    )
    runner_cls._copy_draft_token_ids_to_cpu(runner, types.SimpleNamespace())
    assert runner.prev_num_spec_tokens == 0
    assert runner_cls.take_draft_token_ids(runner) is None
