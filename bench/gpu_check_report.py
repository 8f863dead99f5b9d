"""The text summary of bench/gpu_check.py's report: one line per measured number, `n/a` where a
section was skipped or failed (its reason is on the sections lines)."""

from __future__ import annotations


def _fmt(value: object, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def _optional(name: str, result: object) -> str:
    if not isinstance(result, dict):
        return f"  {name}  {result}"
    parts = []
    for key, value in result.items():
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        parts.append(f"{key}={_fmt(value, '{:.4g}')}" if is_number else f"{key}={value}")
    return f"  {name}  " + ", ".join(parts)


def summary(report: dict) -> str:
    def get(key: str, fmt: str = "{:.3g}") -> str:
        return _fmt(report.get(key), fmt)

    def fb(prefix: str, mfu_key: str) -> str:
        return (
            f"{get(f'{prefix}_tokens_per_s', '{:,.0f}')} tokens/s,"
            f" {get(f'{prefix}_tflops_per_s')} TFLOP/s, MFU {get(mfu_key, '{:.1%}')},"
            f" peak {get(f'{prefix}_max_memory_gib', '{:.1f}')} GiB"
        )

    rate = "{:,.0f}"
    sections = report.get("sections", {})
    lines = [
        f"device {report['device']} ({report.get('gpu', 'cpu')}), {report['model']},"
        f" {report['dtype']}; {get('wall_seconds', '{:.0f}')} s of the"
        f" {get('budget_s', '{:.0f}')} s budget (setup {get('setup_seconds', '{:.0f}')} s;"
        f" estimates scaled {get('pace', '{:.2f}')}x)",
        "  sections  " + "; ".join(f"{k}: {v}" for k, v in sections.items()),
        f"  sampler vs forward logprobs, max |diff|  LoRA {get('sampler_vs_forward_max_abs_diff')},"
        f" full weight {get('sampler_vs_forward_full_weight_max_abs_diff')}",
        f"  fused prefix attention vs matmuls (out/lse)  "
        f"{get('fused_attention_max_abs_diff_out')} / {get('fused_attention_max_abs_diff_lse')},"
        f" {get('fused_attention_speedup_vs_matmuls', '{:.2f}')}x faster",
        f"  forward-backward {report.get('fb_shape')} (peak {get('peak_tflops')} TFLOP/s;"
        " FLOPs of the work done; target >= 40%)",
        f"    posttrain LoRA r32       {fb('fb', 'mfu')} (6N convention {get('mfu_6n', '{:.1%}')})",
        f"    transformers LoRA r32    {fb('transformers_fb_lora', 'transformers_fb_lora_mfu')}"
        f" [{report.get('transformers_fb_lora_impl')}];"
        f" posttrain / transformers {get('fb_lora_over_transformers', '{:.2f}')}x",
        f"    posttrain full weight    {fb('fb_full', 'fb_full_mfu')}",
        f"    transformers full weight {fb('transformers_fb_full', 'transformers_fb_full_mfu')};"
        f" posttrain / transformers {get('fb_full_over_transformers', '{:.2f}')}x",
        f"  decode  {get('decode_step_ms')} ms/step for {report.get('decode_rows')} rows,"
        f" {get('decode_tokens_per_s', rate)} tokens/s,"
        f" {get('decode_achieved_tb_per_s')} TB/s read;"
        f" {get('decode_fraction_of_bandwidth_limit', '{:.1%}')} of the bandwidth limit"
        f" ({get('decode_bandwidth_limit_tokens_per_s', rate)} tokens/s)",
        f"  sampler vs generate ({report.get('rl_shape')})"
        f"  {get('sampler_over_generate', '{:.2f}')}x"
        f" (paired {get('sampler_over_generate_paired', '{:.2f}')}x; target >= 3x):"
        f" {get('sampler_tokens_per_s', rate)} vs {get('generate_tokens_per_s', rate)} tokens/s",
        f"  sampler vs generate, static cache (compiled: {report.get('generate_static_compiled')})"
        f"  {get('sampler_over_generate_static', '{:.2f}')}x:"
        f" {get('generate_static_tokens_per_s', rate)} tokens/s after a first call of"
        f" {get('generate_static_first_call_s', '{:.1f}')} s"
        + (
            f" (compile failed, eager: {report['generate_static_compile_error']})"
            if "generate_static_compile_error" in report
            else ""
        ),
        f"  decode paths  {get('decode_graphs_tokens_per_s', rate)} tokens/s static"
        " passes in CUDA graphs (eager off CUDA),"
        f" {get('decode_static_eager_tokens_per_s', rate)} static eager,"
        f" {get('decode_blocks_tokens_per_s', rate)} dynamic blocks (--cuda-graphs off),"
        f" {get('decode_per_token_tokens_per_s', rate)} per-token dynamic"
        f" (graphs / per-token {get('decode_graphs_over_per_token', '{:.2f}')}x)",
        f"  decode paths, short ({report.get('decode_short_shape')})"
        f"  {get('decode_short_graphs_tokens_per_s', rate)} graphs vs"
        f" {get('decode_short_blocks_tokens_per_s', rate)} dynamic blocks tokens/s"
        f" ({get('decode_short_graphs_over_blocks', '{:.2f}')}x)",
        "  whole calls against the bandwidth limit (prefill included)  graphs"
        f" {get('decode_graphs_fraction_of_bound', '{:.1%}')}, dynamic blocks"
        f" {get('decode_blocks_fraction_of_bound', '{:.1%}')}, static eager"
        f" {get('decode_static_eager_fraction_of_bound', '{:.1%}')}, per-token"
        f" {get('decode_per_token_fraction_of_bound', '{:.1%}')}; generate dynamic"
        f" {get('generate_fraction_of_bound', '{:.1%}')}, static"
        f" {get('generate_static_fraction_of_bound', '{:.1%}')}",
        f"  {report.get('cuda_graphs_decision', '--cuda-graphs default: undecided')}",
        f"  multi-LoRA ({report.get('multi_lora_shape')})"
        f"  {get('multi_lora_batched_tokens_per_s', rate)} tokens/s in one batch,"
        f" {get('multi_lora_one_at_a_time_tokens_per_s', rate)} one at a time"
        f" ({get('multi_lora_batched_over_one_at_a_time', '{:.2f}')}x),"
        f" {get('multi_lora_one_adapter_tokens_per_s', rate)} all on one adapter"
        f" ({get('multi_lora_batched_over_one_adapter', '{:.2f}')}x)",
        f"  stream ({report.get('stream_shape')})"
        f"  {get('stream_one_op_ops_per_s', '{:.3g}')} ops/s one per call,"
        f" {get('stream_32_batched_ops_per_s', '{:.3g}')} ops/s 32 in one call"
        f" ({get('stream_32_batched_over_one_op', '{:.2f}')}x)",
        "  stream, joining a running generation one per block  "
        + (
            f"{get('stream_join_ops_per_s', '{:.3g}')} ops/s"
            f" ({get('stream_join_over_one_op', '{:.2f}')}x one per call),"
            f" median latency {get('stream_join_op_latency_s', '{:.3g}')} s;"
            f" {get('stream_join_layouts', '{:.0f}')} layouts (captures with graphs),"
            f" {get('stream_join_prefills', '{:.0f}')} eager prefill passes and"
            f" {get('stream_join_prefill_steps', '{:.0f}')} through prefill steps"
            if "stream_join_ops_per_s" in report
            else str(report.get("stream_join", "n/a"))
        ),
        "  stream, the 8 adapters in turn  "
        + (
            f"{get('stream_adapters_ops_per_s', '{:.3g}')} ops/s, median latency"
            f" {get('stream_adapters_op_latency_s', '{:.3g}')} s;"
            f" {get('stream_adapters_layouts', '{:.0f}')} layouts,"
            f" {get('stream_adapters_prefills', '{:.0f}')} eager prefill passes and"
            f" {get('stream_adapters_prefill_steps', '{:.0f}')} through prefill steps"
            if "stream_adapters_ops_per_s" in report
            else "n/a (no multi_lora sessions)"
        ),
        f"  agents in a closed loop ({report.get('agents_shape')})  while all run"
        f" {get('agents_whole_ops_s')} -> {get('agents_joining_ops_s')} ops/s joining"
        f" ({get('agents_joining_over_whole_ops_s', '{:.2f}')}x; tokens/s"
        f" {get('agents_joining_over_whole_tokens_s', '{:.2f}')}x, whole run"
        f" {get('agents_joining_over_whole_whole_run_ops_s', '{:.2f}')}x), latency median"
        f" {get('agents_whole_latency_median_s')} -> {get('agents_joining_latency_median_s')} s,"
        f" same tokens in {get('agents_same_tokens_ops', '{}')} of {get('agents_ops', '{}')}"
        f" operations (where not, neighbouring ids at the first difference, a draw on a CDF"
        f" boundary within rounding: {report.get('agents_differences_are_neighbours', 'n/a')})",
        f"  agents, dynamic passes (--cuda-graphs off)  while all run"
        f" {get('agents_eager_whole_ops_s')} -> {get('agents_eager_joining_ops_s')} ops/s joining"
        f" ({get('agents_eager_joining_over_whole_ops_s', '{:.2f}')}x), latency median"
        f" {get('agents_eager_whole_latency_median_s')} ->"
        f" {get('agents_eager_joining_latency_median_s')} s; graphs / dynamic: whole batches"
        f" {get('agents_graphs_over_eager_whole_ops_s', '{:.2f}')}x, joining"
        f" {get('agents_graphs_over_eager_joining_ops_s', '{:.2f}')}x ops/s; joins inside the"
        f" decode pass / apart {get('agents_eager_joining_over_apart_ops_s', '{:.2f}')}x ops/s",
        f"  agents, joins into padding rows / always appending (graphs)"
        f" {get('agents_joining_over_append_ops_s', '{:.2f}')}x ops/s, captures"
        f" {get('agents_append_layouts', '{:.0f}')} -> {get('agents_joining_layouts', '{:.0f}')}"
        f" (whole batches {get('agents_whole_layouts', '{:.0f}')})",
        f"  weights sync (publish)  LoRA {get('weights_sync_ms')} ms"
        f" ({get('weights_sync_gb_per_s')} GB/s), full weight {get('weights_sync_full_ms')} ms"
        f" ({get('weights_sync_full_gb_per_s')} GB/s)",
        _optional("fsdp2", report.get("fsdp2", "n/a")),
        _optional("vllm", report.get("vllm", "n/a")),
    ]
    return "\n".join(lines)
