"""jax_ep.bench.command_buffers: which jax_ep custom calls sit inside XLA command buffers."""

from jax_ep.bench import command_buffers

# The shape of XLA:GPU's optimized HLO after CommandBufferScheduling: a run of
# commands moved into a computation named command_buffer*, called from ENTRY.
HLO = """HloModule jit_looped, entry_computation_layout={(bf16[128,7168]{1,0})->f32[1]{0}}

%fused_pick (param_0: s32[256]) -> f32[] {
  %param_0 = s32[256]{0} parameter(0)
  ROOT %convert = f32[] convert(%param_0)
}

%command_buffer (p: bf16[128,7168], q: s32[128,8]) -> (bf16[256,128,7168], s32[256]) {
  %p = bf16[128,7168]{1,0} parameter(0)
  %q = s32[128,8]{1,0} parameter(1)
  %custom-call.1 = (bf16[256,128,7168]{2,1,0}, s32[256]{0}) custom-call(%p, %q), custom_call_target="jax_ep_ll_dispatch", api_version=API_VERSION_TYPED_FFI
  %custom-call.2 = (bf16[256,128,7168]{2,1,0}, s32[256]{0}) custom-call(%p, %q), custom_call_target="jax_ep_ll_dispatch", api_version=API_VERSION_TYPED_FFI
  ROOT %tuple = (bf16[256,128,7168]{2,1,0}, s32[256]{0}) tuple(%custom-call.1, %custom-call.2)
}

ENTRY %main.42 (Arg_0.1: bf16[128,7168], Arg_1.2: s32[128,8]) -> f32[1] {
  %Arg_0.1 = bf16[128,7168]{1,0} parameter(0)
  %Arg_1.2 = s32[128,8]{1,0} parameter(1)
  %call = (bf16[256,128,7168]{2,1,0}, s32[256]{0}) call(%Arg_0.1, %Arg_1.2), to_apply=%command_buffer
  %custom-call.3 = f32[128,7168]{1,0} custom-call(%Arg_0.1), custom_call_target="jax_ep_ll_combine"
  %custom-call.4 = f32[1]{0} custom-call(%Arg_0.1), custom_call_target="xla_python_gpu_callback"
  ROOT %r = f32[1]{0} fusion(%call), kind=kLoop, calls=%fused_pick
}
"""


def test_counts_calls_inside_and_outside_command_buffers():
  report = command_buffers.custom_calls_in_command_buffers(HLO)
  assert report == dict(total=3, in_command_buffers=2,
                        targets=["jax_ep_ll_combine", "jax_ep_ll_dispatch"])


def test_other_targets_do_not_count():
  report = command_buffers.custom_calls_in_command_buffers(HLO, target_prefix="xla_python")
  assert report["total"] == 1 and report["in_command_buffers"] == 0


def test_no_command_buffers():
  text = HLO.replace("%command_buffer", "%fused_computation")
  assert command_buffers.custom_calls_in_command_buffers(text)["in_command_buffers"] == 0


def test_report_line():
  line = command_buffers.format_report("LL dispatch, no rows",
                                       command_buffers.custom_calls_in_command_buffers(HLO))
  assert line.startswith("command buffers: LL dispatch, no rows: 2 of 3 jax_ep custom calls")
