"""`jfire plan`'s words: a plan (jfire/plan.py's JSON-ready dict) printed for people (`format_plan`),
the pools a plan that fits gives an engine in one line (`format_pool`, printed by serve and launch
with `--kv-cache-gb auto` at start-up), and why a plan does not fit (`format_refusal`, what they
say when they refuse to start).
"""

from __future__ import annotations

from jfire.plan_bytes import GIB


def _gib(n: int) -> str:
    """GiB with two decimals; smaller sizes (tiny models) in MiB or KiB so they do not read as 0."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def _kv_model(p: dict) -> str:
    """The model's own bytes per token, where the mesh stores more (repeated or per-stage)."""
    model = p.get("kv_bytes_per_token_model")
    if model is None or model == p["kv_bytes_per_token"]:
        return ""
    return f" (the model's cache: {_kib(model)}, each layer once; the rest is stored again on other devices)"


def _quantized_line(p: dict) -> str:
    """The parameters line's tail: the weights held quantized, beside their scales."""
    parts = []
    if p.get("int4_parameters"):
        parts.append(f"{p['int4_parameters']:,} int4 weights ({_gib(p['int4_bytes'])}, 8 per int32 word)")
    if p.get("fp8_parameters"):
        parts.append(f"{p['fp8_parameters']:,} FP8 weights ({_gib(p['fp8_bytes'])}, a byte each)")
    if not parts:
        return ""
    return f", except {' and '.join(parts)} and their scales ({_gib(p['scale_bytes'])}: bytes, not parameters)"


def _throughput_lines(p: dict) -> list[str]:
    """The plan's throughput and cost on paper, in a few lines (jfire/throughput.py)."""
    t = p.get("throughput")
    if t is None:
        return ["throughput  not on paper: the mesh file's [device] table gives no memory_tb_per_s and bf16_tflops"]
    a = t["assumptions"]
    link = f", link {a['link_bytes_per_s'] / 1e9:g} GB/s" if a["link_bytes_per_s"] else ""
    head = (
        f"throughput  bounds on paper (docs/plan.md): {a['device'] or 'a device'} at "
        f"{a['memory_bytes_per_s'] / 1e12:g} TB/s, {a['bf16_flops_per_s'] / 1e12:g} bf16 TFLOP/s{link}; "
        f"{a['devices_reading_at_once']} devices read at once"
    )
    if a["pipeline_ticks"]:
        head += (
            f" per stage, a step of b rows in m + {p['mesh']['pp'] - 1} ticks of b/m "
            f"(m micro-batches, at most {p['mesh']['microbatches']})"
        )
    usd = t["usd_per_million_output_tokens"]
    price = f"${a['usd_per_device_hour']:g} per device-hour" + (
        ", the default: --usd-per-device-hour" if a["usd_per_device_hour_source"] == "default" else ""
    )
    lines = [
        head,
        f"decode      tok/s ($ per M output tokens at {price}), rows {a['kv_context_tokens']:,} tokens deep: "
        + ", ".join(f"batch {b}: {n:,.0f} (${usd[b]:.2f})" for b, n in t["decode_tokens_per_s"].items()),
    ]
    if t["ttft_s"]:
        lines.append(
            f"prefill     TTFT, one prompt in {a['prefill_chunk_tokens']}-token chunks, FLOPs at "
            f"{a['efficiency']['prefill_flops']:.0%} of peak: "
            + ", ".join(
                f"{int(n):,} tokens {s:.3g} s ({t['prefill_tokens_per_s'][n]:,.0f} tok/s)"
                for n, s in t["ttft_s"].items()
            )
        )
    if a["experts_touched_per_layer"]:
        lines.append(
            f"experts     touched per layer, of {a['experts']} (top-{a['experts_per_token']})"
            + (", a micro-batch's rows at a time" if a["pipeline_ticks"] else "")
            + ": "
            + ", ".join(f"{n:.1f} at batch {b}" for b, n in a["experts_touched_per_layer"].items())
        )
    return lines


def _tightest(p: dict) -> dict:
    """The device with the least room for the KV cache."""
    return min(p["per_device"], key=lambda d: d["kv_bytes_free"])


def _memory_sum(p: dict, d: dict) -> str:
    """Device d's memory, less what the plan takes from it, in words and figures."""
    tower = f" - vision tower {_gib(d['vision_param_bytes'])}" if d.get("vision_param_bytes") else ""
    encoder = (
        "the image encoder's, the larger: "
        if d.get("encoder_workspace_bytes", 0) > p["workspace_bytes_per_device"]
        else ""
    )
    return (
        f"device memory {_gib(d['memory_bytes'])} (from {p['device_memory_source']}) - weights "
        f"{_gib(d['weight_bytes'])}{tower} - workspace {_gib(d['workspace_bytes'])} ({encoder}{p['workspace_source']}: "
        f"--max-batch {p['max_batch']}, --prefill-budget {p['prefill_budget']}) - reserve "
        f"{_gib(d['reserve_bytes'])} leaves {_gib(d['kv_bytes_free'])} for the KV cache"
    )


def _groups(p: dict) -> dict:
    """The plan's pools by cache group worth a line each: all of them where there are several or
    one is windowed; none for one pool of full attention (the plan says it all)."""
    groups = p.get("kv_groups") or {}
    return groups if len(groups) > 1 or any(g["window"] for g in groups.values()) else {}


def _pages(p: dict, noun: str = "pages") -> str:
    """The pools' pages in words: "N pages of 16", each group's where there are several."""
    text = f"{p['kv_pages']:,} {noun} of {p['page_size']}"
    groups = _groups(p)
    if len(groups) < 2:
        return text
    if p["kv_pools_shared"]:
        return f"{text} in one pool for the {' and '.join(groups)} layers"
    return ", ".join(f"{g['pages']:,} {name}" for name, g in groups.items()) + f" {noun} of {p['page_size']}"


def format_pool(p: dict) -> str:
    """The pools a plan that fits gives an engine, in one line (serve and launch with
    `--kv-cache-gb auto` print it at start-up)."""
    d = _tightest(p)
    one_pool = (
        f"; an engine keeping one pool (moving pages by id): {p['kv_pages_one_pool']:,} pages for every group"
        if len(_groups(p)) > 1 and not p["kv_pools_shared"]
        else ""
    )
    return (
        f"{_pages(p, 'KV pages')} tokens, {_gib(p['kv_cache_bytes_per_device'])} per device "
        f"({p['kv_capacity_tokens'] / p['max_context']:.1f} contexts of {p['max_context']:,}{one_pool}): "
        + _memory_sum(p, d)
    )


def format_refusal(p: dict) -> str:
    """Why a plan does not fit, as one paragraph with its figures, for the device with the least
    room: what `jfire serve` and `launch` say when `--kv-cache-gb auto` refuses to start."""
    d = _tightest(p)
    where = (
        f"device {d['index']} of the {p['devices']} of mesh {p['mesh']['name']!r}" if p["devices"] > 1 else "one device"
    )
    groups = _groups(p)
    windows = (
        ", beside every row's window of the "
        + " and ".join(name for name, g in groups.items() if g["window"])
        + " layers,"
        if len(groups) > 1
        else ""
    )
    a_token = (
        " and ".join(
            f"{_kib(g['page_bytes_per_device'] // p['page_size'])} a token in the {name} layers"
            for name, g in groups.items()
        )
        if groups
        else f"{_kib(d['kv_bytes_per_token'])} a token"
    )
    return (
        f"{p['model']} ({p['dtype']}) does not fit {where} with room for one full context: "
        + _memory_sum(p, d)
        + f", and one {p['max_context']:,}-token context{windows} needs {_gib(p['kv_context_bytes_per_device'])} "
        f"({a_token}). Lower --max-context, --max-batch or --prefill-budget, "
        + ("load the weights in bfloat16 (--dtype), " if p["dtype"] != "bfloat16" else "")
        + "spread the model over more devices (--mesh), or state the devices' memory with --device-memory-gib "
        "if they have more (jfire plan --no-compile prints the same figures)"
    )


def _group_line(p: dict, name: str, g: dict) -> str:
    """One cache group's pool: its pages, their bytes, and what its layers attend."""
    if g["attends"] == "all":
        attends = "every earlier position"
    else:
        what = "chunks" if g["attends"] == "chunk" else "a sliding window"
        step = f"with a {p['prefill_budget']}-token step"
        attends = (
            f"{what} of {g['window']:,} tokens, {p['max_batch']} rows x {g['pages_per_row']:,} pages "
            f"(the most a row holds at once, {step})"
            if g["pages"] == p["max_batch"] * g["pages_per_row"]
            else f"{what} of {g['window']:,} tokens, a row at most {g['pages_per_row']:,} pages at once ({step})"
        )
    return (
        f"            {name}: {g['pages']:,} pages, {_gib(g['bytes_per_device'])} per device, "
        f"{_kib(g['kv_bytes_per_token'])} per token over all devices; its layers attend {attends}"
    )


def _devices(indices: list[int]) -> str:
    return ("device " if len(indices) == 1 else "devices ") + ", ".join(map(str, indices))


def _vision_line(v: dict) -> str:
    """The image encoder's params and where the engine keeps them."""
    return (
        f"vision      {v['parameters']:,} ({_count(v['parameters'])}) more in the vision tower and projector, "
        f"{_gib(v['param_bytes'])}: {v['dtype']}, whole on {_devices(v['devices'])} "
        f"(each process's first device, as the engine loads it; not split over the mesh)"
    )


def _encoder_line(p: dict, v: dict) -> str:
    """The image encoder's largest call, and how its device counts it."""
    measured = (
        f"measured {_gib(v['workspace_bytes'])} (temp {_gib(v['temp_bytes'])} + outputs "
        f"{_gib(v['output_bytes'])} + pixels {_gib(v['input_bytes'])}), "
        if "workspace_bytes" in v
        else ""
    )
    return (
        f"encoder     {v['encoder_call']}: {measured}estimate {_gib(v['estimate_bytes'])}; "
        f"it runs between the programs, so device {v['encoder_device']} counts the larger workspace"
    )


def format_plan(p: dict) -> str:
    mesh = p["mesh"]
    axes = " ".join(f"{a}={mesh[a]}" for a in ("dp", "pp", "tp", "ep"))
    devices = f"{p['devices']} x {p['device_kind']}" if p["device_kind"] else f"{p['devices']} devices"
    lines = [
        f"model       {p['model']} ({p['family']}, {p['architecture']})",
        f"parameters  {p['parameters']:,} ({_count(p['parameters'])}), {_gib(p['parameter_bytes'])}: {p['dtype']}"
        + _quantized_line(p),
        f"mesh        {mesh['name']} ({axes}): {devices}, {p['device_memory_gib']:g} GiB each "
        f"(from {p['device_memory_source']})",
    ]
    vision = p.get("vision")
    if vision:
        lines.append(_vision_line(vision))
    if p["kv_head_replication"] > 1:
        lines.append(f"kv heads    repeated {p['kv_head_replication']}x so each tp shard owns one (counted below)")
    tower = f"{'vision':>12}" if vision else ""
    lines += [
        "",
        f"{'device':<8}{'memory':>12}{'weights':>13}{tower}{'workspace':>13}{'reserve':>12}{'KV free':>12}{'KV/token':>11}",
    ]
    for d in p["per_device"]:
        tower = f"{_gib(d['vision_param_bytes']) if d['vision_param_bytes'] else '-':>12}" if vision else ""
        lines.append(
            f"{d['index']:<8}{_gib(d['memory_bytes']):>12}{_gib(d['weight_bytes']):>13}{tower}"
            f"{_gib(d['workspace_bytes']):>13}{_gib(d['reserve_bytes']):>12}{_gib(d['kv_bytes_free']):>12}"
            f"{_kib(d['kv_bytes_per_token']):>11}"
        )
    lines.append("")
    source = p["workspace_source"]
    lines.append(f"workspace   {_gib(p['workspace_bytes_per_device'])} per device, {source}: {p['workspace_note']}")
    for d in p["workspace_programs"]:
        shape = f"{d['program']} {d['rows']} x {d['tokens_per_row']} tokens, {d['pages_per_row']} pages/row"
        measured = (
            f"measured {_gib(d['workspace_bytes'])} (temp {_gib(d['temp_bytes'])} + outputs "
            f"{_gib(d['output_bytes'])}), "
            if "workspace_bytes" in d
            else ""
        )
        lines.append(f"              {shape}: {measured}estimate {_gib(d['estimate_bytes'])}")
    if vision:
        lines.append(_encoder_line(p, vision))
    lines.append(f"reserve     {_gib(p['reserve_bytes_per_device'])} per device, {p['reserve_note']}")
    groups = _groups(p)
    lines += [
        "",
        f"KV cache    {_gib(p['kv_bytes_free_total'])} free in all; {_kib(p['kv_bytes_per_token'])} per token over all "
        f"devices{_kv_model(p)} -> {p['kv_capacity_tokens']:,} tokens "
        f"({p['kv_capacity_tokens'] / p['max_context']:.1f} sequences of {p['max_context']:,})"
        + (", a pool per kind of layer, every row's window reserved:" if len(groups) > 1 else ":" if groups else "")
        if p["kv_capacity_tokens"]
        else f"KV cache    no room ({_gib(p['kv_bytes_free_total'])} free in all)",
    ]
    if p["kv_capacity_tokens"]:
        lines += [_group_line(p, name, g) for name, g in groups.items()]
    if p["fits"]:
        lines.append(
            f"fits        yes: serve with --kv-cache-gb {p['kv_cache_gb_per_device']:g} "
            f"({_pages(p)}); limits: --max-batch {p['max_batch']} "
            f"--prefill-budget {p['prefill_budget']} --max-context {p['max_context']}"
        )
        lines.append(
            "            (on a GPU, serve and launch default to --kv-cache-gb auto: this arithmetic at start-up, "
            "the workspace estimated as by --no-compile; docs/plan.md)"
        )
    else:
        lines.append("fits        no: " + "; ".join(p["problems"]))
    return "\n".join(lines + _throughput_lines(p))
