"""Inputs built from the config for the zoo types whose forward is not text-only (issue 42).

``non_text_inputs(model_type, model, config, forward_params)`` returns the keyword inputs of one small forward
(a seeded generator, as ``zoo._build`` makes its text inputs): images (flattened patches with their grid for
Qwen-style towers, pixel values elsewhere), audio (waveforms, mel features, codec latents), ``hidden_states``
for towers that take embeddings, text with an image span for multimodal models, an inference session for the
SAM video trackers; or a str saying why none can be made. ``CONFIG_FIXES`` mend default configs that do not
build or run once shrunk (each says why, from the model's code). ``zoo.build`` uses both: a type with a
builder here runs on its inputs, every type's shrunk config goes through its fix. Shapes follow transformers
5.23.0's modeling code (pointers in the comments).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

TOKENS = 16  # as zoo.TOKENS
SEED = 0
MERGED = 2  # merged tokens per side for qwen-style towers: a (MERGED*merge)**2 patch grid


def _gen(salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + 1 + salt)


def _ids(config: Any, count: int = TOKENS, salt: int = 0) -> torch.Tensor:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or 256
    return torch.randint(4, min(vocab, 256) - 40, (1, count), generator=_gen(salt))


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _vision(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


# -- vision towers ------------------------------------------------------------------------------------

def qwen_patches(vc: Any, merged: int = MERGED) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL style flattened patches: ``(t*h*w, C*T*P*P)`` plus ``grid_thw`` ``[[1, h, w]]`` in patches
    (qwen2_5_vl/modeling_qwen2_5_vl.py PatchEmbed.forward views ``-1, C, T, P, P``)."""
    merge = _get(vc, "spatial_merge_size", "merge_size", default=2)
    if isinstance(merge, (list, tuple)):
        merge = merge[0]
    side = merged * merge
    channels = _get(vc, "in_channels", "in_chans", "num_channels", default=3)
    temporal = _get(vc, "temporal_patch_size", "patch_temporal", default=1)
    patch = vc.patch_size
    grid = torch.tensor([[1, side, side]])
    values = torch.randn(side * side, channels * temporal * patch * patch, generator=_gen())
    return values, grid


def _grid_thw_tower(model_type, model, config, params):
    values, grid = qwen_patches(config)
    first = next(p for p in params if p != "self")
    return {first: values, "grid_thw": grid}


def _image(vc: Any, side: int, batch: int = 1) -> torch.Tensor:
    channels = _get(vc, "num_channels", "in_channels", "in_chans", default=3)
    return torch.randn(batch, channels, side, side, generator=_gen())


def _pixtral(model_type, model, config, params):
    vc = _vision(config)
    side = 4 * vc.patch_size  # a 4x4 patch grid
    return {"pixel_values": _image(vc, side), "image_sizes": torch.tensor([[side, side]])}


def _gemma4_vision(model_type, model, config, params):
    # gemma4/modeling_gemma4.py Gemma4VisionModel.forward: pixel_values (batch, patches, 3*P*P) and
    # pixel_position_ids (batch, patches, 2) as (x, y); the pooler takes pooling_kernel_size**2 patches
    k = config.pooling_kernel_size
    side = 2 * k
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], -1)[None]
    values = torch.rand(1, side * side, 3 * config.patch_size**2, generator=_gen())
    return {"pixel_values": values, "pixel_position_ids": positions}


def _kimi_k25_vision(model_type, model, config, params):
    # kimi_k25/modeling_kimi_k25.py patch_embed: Conv2d(3, ...) over (patches, 3, P, P); grid in patches,
    # pooled by merge_kernel_size
    kh, kw = config.merge_kernel_size
    h, w = 2 * kh, 2 * kw
    values = torch.randn(h * w, 3, config.patch_size, config.patch_size, generator=_gen())
    return {"pixel_values": values, "grid_thw": torch.tensor([[1, h, w]])}


def _inkling2_vision(model_type, model, config, params):
    # inkling2/modeling_inkling2.py Inkling2VisionModel.forward: pixel_values
    # (image tokens, P*merge, P*merge, C), image_grid_thw counted in image tokens
    merge, patch = config.spatial_merge_size, config.patch_size
    h = w = MERGED
    values = torch.rand(h * w, patch * merge, patch * merge, config.num_channels, generator=_gen()) * 2 - 1
    return {"pixel_values": values, "image_grid_thw": torch.tensor([[1, h, w]])}


def _muse_vision(model_type, model, config, params):
    # muse_glimmer/modeling_muse_glimmer.py PatchEmbedder: Linear(patch_temporal*3*P*P) over flat patches
    values, grid = qwen_patches(config)
    return {"pixel_values": values, "grid_thw": grid}


def _video_llama_3_vision(model_type, model, config, params):
    # video_llama_3/modeling_video_llama_3.py embeddings view (-1, C, P, P); merge_sizes per image
    side = 2 * 2
    values = torch.randn(side * side, config.num_channels * config.patch_size**2, generator=_gen())
    return {"pixel_values": values, "grid_thw": torch.tensor([[1, side, side]]), "merge_sizes": torch.tensor([2])}


def _square_image(multiple: int = 4) -> Callable:
    def build(model_type, model, config, params):
        vc = _vision(config)
        patch = vc.patch_size
        if isinstance(patch, (list, tuple)):
            patch = patch[0]
        return {"pixel_values": _image(vc, multiple * patch)}
    return build


def _full_image(model_type, model, config, params):
    vc = _vision(config)
    size = vc.image_size
    if isinstance(size, (list, tuple)):
        size = size[0]
    return {"pixel_values": _image(vc, size)}


# -- multimodal text + image ---------------------------------------------------------------------------

def _token(config: Any, *names: str) -> int | None:
    for holder in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if holder is None:
            continue
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int):
                return value
    return None


def _with_image_span(config: Any, count: int, start: int | None = None, end: int | None = None,
                     before: int = 4, after: int = 4, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids: ``before`` text tokens, [start], ``count`` image tokens, [end], ``after`` text tokens; and the
    mm_token_type_ids (1 on the image tokens) the Qwen/GLM processors return alongside."""
    image = _token(config, "image_token_id", "image_token_index")
    parts = [_ids(config, before, salt)[0]]
    types = [torch.zeros(before, dtype=torch.long)]
    if start is not None:
        parts.append(torch.tensor([start]))
        types.append(torch.zeros(1, dtype=torch.long))
    parts.append(torch.full((count,), image))
    types.append(torch.ones(count, dtype=torch.long))
    if end is not None:
        parts.append(torch.tensor([end]))
        types.append(torch.zeros(1, dtype=torch.long))
    parts.append(_ids(config, after, salt + 7)[0])
    types.append(torch.zeros(after, dtype=torch.long))
    return torch.cat(parts)[None], torch.cat(types)[None]


def _qwen_style_mm(model_type, model, config, params):
    """Qwen2-VL / GLM-4V style: flattened patches, image_grid_thw in patches, (h*w)/merge**2 image tokens
    between vision start/end tokens, mm_token_type_ids for get_rope_index (glm4v/modeling_glm4v.py:949)."""
    vc = config.vision_config
    values, grid = qwen_patches(vc)
    merge = vc.spatial_merge_size
    count = int(grid.prod()) // merge**2
    ids, types = _with_image_span(config, count, _token(config, "vision_start_token_id", "image_start_token_id"),
                                  _token(config, "vision_end_token_id", "image_end_token_id"))
    made = {"input_ids": ids, "pixel_values": values, "image_grid_thw": grid}
    if "mm_token_type_ids" in params:
        made["mm_token_type_ids"] = types
    return made


def _glm_image(model_type, model, config, params):
    """GLM-Image image-to-image: a source image (start, h*w image tokens, end) then the start of the target
    image; image_grid_thw lists the source grid and the target grid (glm_image/modeling_glm_image.py:1298)."""
    vc = config.vision_config
    side = 4
    values = torch.randn(side * side, vc.in_channels * vc.patch_size**2, generator=_gen())
    start, end = config.image_start_token_id, config.image_end_token_id
    ids, _ = _with_image_span(config, side * side, start, end)
    ids = torch.cat([ids, torch.tensor([[start]])], 1)
    grid = torch.tensor([[1, side, side], [1, side, side]])
    return {"input_ids": ids, "pixel_values": values, "image_grid_thw": grid, "images_per_sample": torch.tensor([2])}


def _hunyuan_vl(model_type, model, config, params):
    """HunYuanVL: flat (patches, C*P*P) pixel values, grid in patches; the image span holds as many image tokens
    as the patch merger returns (hunyuan_vl/modeling_hunyuan_vl.py get_rope_index accepts grid tokens or +2)."""
    vc = config.vision_config
    side = 2 * vc.spatial_merge_size
    values = torch.randn(side * side, vc.num_channels * vc.patch_size**2, generator=_gen())
    grid = torch.tensor([[1, side, side]])
    with torch.no_grad():
        features = model.vision_tower(values, grid_thw=grid).pooler_output
    count = features.shape[-2]
    ids, types = _with_image_span(config, count)
    return {"input_ids": ids, "pixel_values": values, "image_grid_thw": grid, "mm_token_type_ids": types}


def _idefics(model_type, model, config, params):
    """Idefics: pixel_values (batch, images, C, H, W) at the vision image_size, and image_attention_mask
    (batch, text, images) saying which text tokens see which image (idefics/modeling_idefics.py:945)."""
    vc = config.vision_config
    ids = _ids(config)
    image = _token(config, "image_token_id", "image_token_index")
    if image is not None:
        ids[0, 2] = image
    pixels = torch.randn(1, 1, vc.num_channels, vc.image_size, vc.image_size, generator=_gen(3))
    return {"input_ids": ids, "pixel_values": pixels, "image_attention_mask": torch.ones(1, TOKENS, 1, dtype=torch.long)}


def _step3p7(model_type, model, config, params):
    """Step3p7: one global view (1, 3, image_size, image_size), no local patches; as many image tokens as
    get_image_features returns (step3p7/modeling_step3p7.py:968)."""
    vc = config.vision_config
    pixels = torch.randn(1, vc.num_channels, vc.image_size, vc.image_size, generator=_gen())
    with torch.no_grad():
        features = model.get_image_features(pixels, return_dict=True).pooler_output
    count = sum(f.shape[0] for f in features)
    ids, _ = _with_image_span(config, count)
    return {"input_ids": ids, "pixel_values": pixels}


def _qwen3_omni_thinker(model_type, model, config, params):
    """Qwen3-Omni thinker: text + one image as Qwen3-VL (vision start/end); compute_3d_position_ids
    (modeling_qwen3_omni_moe.py:1904) computes M-RoPE positions only with an attention_mask."""
    made = _qwen_style_mm(model_type, model, config, params)
    made["attention_mask"] = torch.ones_like(made["input_ids"])
    return made


# -- audio ----------------------------------------------------------------------------------------------

def _features_btm(frames: int) -> Callable:
    """input_features (batch, frames, mel bins)."""
    def build(model_type, model, config, params):
        bins = _get(config, "num_mel_bins", "feature_projection_input_dim", "input_feat_size")
        return {"input_features": torch.randn(1, frames, bins, generator=_gen())}
    return build


def _features_bmt(frames: int) -> Callable:
    """input_features (batch, mel bins, frames)."""
    def build(model_type, model, config, params):
        bins = _get(config, "num_mel_bins", "feature_size")
        return {"input_features": torch.randn(1, bins, frames, generator=_gen())}
    return build


def _wav2vec2_bert(model_type, model, config, params):
    # the feature extractor stacks 2 mel frames of 80 bins: (batch, frames, feature_projection_input_dim)
    return {"input_features": torch.randn(1, 32, config.feature_projection_input_dim, generator=_gen())}


def _waveform(samples_of: Callable[[Any], int], channels: bool) -> Callable:
    def build(model_type, model, config, params):
        samples = samples_of(config)
        shape = (1, _get(config, "audio_channels", default=1), samples) if channels else (1, samples)
        return {"input_values": torch.randn(*shape, generator=_gen()) * 0.1}
    return build


def _moonshine(model_type, model, config, params):
    made = _waveform(lambda c: 16000, False)(model_type, model, config, params)
    made["decoder_input_ids"] = _ids(config)
    return made


def _codec_with_semantic(model_type, model, config, params):
    # neucodec / xcodec2 encode(): acoustic input_values (batch, 1, samples) and the semantic encoder's
    # Wav2Vec2-BERT input_features (batch, frames, 160); the two streams are cut to the shorter
    hop = config.hop_length
    samples = hop * 16
    frames = 16
    dim = config.semantic_model_config.feature_projection_input_dim
    return {"input_values": torch.randn(1, 1, samples, generator=_gen()) * 0.1,
            "input_features": torch.randn(1, frames, dim, generator=_gen(2))}


def _latents(model_type, model, config, params):
    # mimi/modeling_mimi.py:1316 latents (batch, hidden_size, frames)
    return {"latents": torch.randn(1, config.hidden_size, 8, generator=_gen())}


def _pe_audio_encoder(model_type, model, config, params):
    hop = config.dac_config.hop_length
    return {"input_values": torch.randn(1, 1, hop * 16, generator=_gen()) * 0.1}


def _pe_audio(model_type, model, config, params):
    hop = config.audio_config.dac_config.hop_length
    return {"input_ids": _ids(config), "input_values": torch.randn(1, 1, hop * 16, generator=_gen()) * 0.1}


def _pe_video_encoder(model_type, model, config, params):
    vc = config.vision_config
    size = _get(vc, "image_size", default=224)
    return {"pixel_values_videos": torch.randn(1, 4, 3, size, size, generator=_gen())}


def _pe_audio_video_encoder(model_type, model, config, params):
    made = _pe_video_encoder(model_type, model, config.video_config, params)
    made["input_values"] = torch.randn(1, 1, config.audio_config.dac_config.hop_length * 16, generator=_gen()) * 0.1
    return made


def _voxtral_realtime_encoder(model_type, model, config, params):
    return {"input_features": torch.randn(1, config.num_mel_bins, 64, generator=_gen())}


def _voxtral_realtime(model_type, model, config, params):
    # voxtral_realtime/modeling_voxtral_realtime.py:886: the encoder halves the frames (conv2 stride 2), the
    # projector groups downsample_factor of them: one audio embedding per text token
    frames = TOKENS * 2 * config.downsample_factor
    return {"input_ids": _ids(config),
            "input_features": torch.randn(1, config.audio_config.num_mel_bins, frames, generator=_gen(2))}


def _clvp(model_type, model, config, params):
    # ClvpConditioningEncoder: mel input_features (batch, feature_size, frames)
    bins = config.decoder_config.feature_size
    return {"input_ids": _ids(config), "input_features": torch.randn(1, bins, 32, generator=_gen(2))}


def _kyutai(model_type, model, config, params):
    # kyutai_speech_to_text/modeling_kyutai_speech_to_text.py:544: input_ids (batch, seq, 1 + num_codebooks):
    # a text token then one code per codebook, each offset into the shared embedding
    text = _ids(config)[..., None]
    codes = torch.randint(0, config.codebook_vocab_size - 1, (1, TOKENS, config.num_codebooks), generator=_gen(2))
    return {"input_ids": torch.cat([text, codes], -1)}


def _dia(model_type, model, config, params):
    # DiaModel: encoder byte ids (batch, seq); decoder audio codes (batch, seq, num_channels)
    dc = config.decoder_config
    codes = torch.randint(0, min(dc.vocab_size, 1024), (1, TOKENS, dc.num_channels), generator=_gen(2))
    return {"input_ids": _ids(config), "decoder_input_ids": codes}


def _timesfm(model_type, model, config, params):
    return {"past_values": torch.randn(1, 4 * config.patch_length, generator=_gen())}


def _muse_glimmer_assistant(model_type, model, config, params):
    # noise_embeds (batch, block_size, hidden); context_hidden_states (batch, ctx, hidden * len(target_layer_ids))
    width = model.encoder.weight.shape[1] if hasattr(model.encoder, "weight") else None
    if width is None:
        width = next(m for m in model.encoder.modules() if isinstance(m, torch.nn.Linear)).in_features
    return {"noise_embeds": torch.randn(1, config.block_size, config.hidden_size, generator=_gen()),
            "context_hidden_states": torch.randn(1, 8, width, generator=_gen(2))}


def _inputs_embeds(model_type, model, config, params):
    return {"inputs_embeds": torch.randn(1, TOKENS, config.hidden_size, generator=_gen())}


def _text_only(model_type, model, config, params):
    return {"input_ids": _ids(config)}


def _video_session(model_type, model, config, params):
    """SAM2-video style trackers take an inference session, not tensors. Build one by hand as the processor's
    add_inputs_to_inference_session does (sam2_video/processing_sam2_video.py process_new_points_or_boxes...):
    a 2-frame video at image_size, one object with one positive click on frame 0 in model coordinates. Frame 0
    is run here (the conditioning frame); the returned inputs track frame 1, which runs the memory attention
    (the RoPE) over frame 0's memory. Re-running frame 1 reads the same memory, so repeats are comparable."""
    import sys
    module = sys.modules[type(model).__module__]
    session_class = next(getattr(module, n) for n in dir(module) if n.endswith("InferenceSession"))
    size = config.image_size
    video = torch.randn(2, 3, size, size, generator=_gen())
    session = session_class(video=video, video_height=size, video_width=size, dtype=torch.float32)
    obj_idx = session.obj_id_to_idx(1)
    session.add_point_inputs(obj_idx, 0, {"point_coords": torch.tensor([[[[size / 2, size / 2]]]]),
                                          "point_labels": torch.tensor([[[1]]], dtype=torch.int32)})
    session.obj_with_new_inputs = [1]
    with torch.no_grad():
        model(inference_session=session, frame_idx=0)
    return {"inference_session": session, "frame_idx": 1}


# -- dispatch -----------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable] = {
    **{t: _grid_thw_tower for t in (
        "cohere_compass_vision", "exaone4_5_vision", "glm4v_moe_vision", "glm4v_vision", "glm5_next_vision",
        "glm_ocr_vision", "qwen2_5_vl_vision", "qwen3_5_moe_vision", "qwen3_5_vision", "qwen3_vl_moe_vision",
        "qwen3_vl_vision", "qwen4_exp_vision", "lfm3_vl_vision",
        "llava_onevision1_5_vision", "ovis2_5_vision")},  # these two: transformers 5.25
    "gemma4_vision": _gemma4_vision,
    "kimi_k25_vision": _kimi_k25_vision,
    "inkling2_vision": _inkling2_vision,
    "muse_glimmer_vision": _muse_vision,
    "muse_spark_vision": _muse_vision,
    "video_llama_3_vision": _video_llama_3_vision,
    "pixtral": _pixtral,
    "mlcd": _square_image(4),
    "mlcd_vision_model": _square_image(4),
    "dinov3_vit": _square_image(4),
    "sapiens2": _square_image(4),
    "sam3_vit_model": _square_image(4),
    "efficientloftr": lambda t, m, c, p: {"pixel_values": torch.randn(1, 2, 3, 64, 64, generator=_gen())},
    **{t: _qwen_style_mm for t in ("glm46v", "glm4v", "glm4v_moe", "glmga")},
    **{t: _text_only for t in ("glm4v_text", "glm4v_moe_text", "glm_image_text", "hunyuan_vl_text",
                               "deepseek_v2", "zamba2")},
    "glm_image": _glm_image,
    "hunyuan_vl": _hunyuan_vl,
    "idefics": _idefics,
    "step3p7": _step3p7,
    "qwen3_omni_moe_thinker": _qwen3_omni_thinker,
    "glmasr_encoder": _features_bmt(64),
    "lasr_encoder": _features_btm(64),
    "nemotron3_5_transcribe_asr_audio": _features_btm(64),
    "nemotron3_diarization_audio": _features_btm(64),
    "nemotron3_5_transcribe_word_timestamp": _inputs_embeds,
    "voxtral_realtime_encoder": _voxtral_realtime_encoder,
    "voxtral_realtime": _voxtral_realtime,
    "wav2vec2-bert": _wav2vec2_bert,
    "wav2vec2-conformer": _waveform(lambda c: 4000, False),
    "moonshine": _moonshine,
    "moonshine_streaming": _moonshine,
    "mimi": _waveform(lambda c: c.frame_size * 4, True),
    "mimi_encoder": _waveform(lambda c: c.frame_size * 4, True),
    "mimi_decoder": _latents,
    "pocket_tts_audio_tokenizer": _waveform(lambda c: c.frame_size * 4, True),
    "pocket_tts_audio_tokenizer_encoder": _waveform(lambda c: c.frame_size * 4, True),
    "pocket_tts_audio_tokenizer_decoder": _latents,
    "neucodec": _codec_with_semantic,
    "xcodec2": _codec_with_semantic,
    "pe_audio": _pe_audio,
    "pe_audio_encoder": _pe_audio_encoder,
    "pe_audio_video_encoder": _pe_audio_video_encoder,
    "pe_video_encoder": _pe_video_encoder,
    "clvp": _clvp,
    "kyutai_speech_to_text": _kyutai,
    "dia": _dia,
    "timesfm2_5": _timesfm,
    "muse_glimmer_assistant": _muse_glimmer_assistant,
    **{t: _video_session for t in ("edgetam_video", "sam2_video", "sam3_tracker_video")},
}


def non_text_inputs(model_type: str, model: torch.nn.Module, config: Any,
                    forward_params: Mapping[str, Any]) -> dict[str, torch.Tensor] | str:
    builder = BUILDERS.get(model_type)
    if builder is None:
        return f"no input builder for {model_type}"
    return builder(model_type, model, config, forward_params)


# -- config fixes (applied to the shrunk dict before from_dict) --------------------

CONFIG_FIXES: dict[str, Callable] = {}


def _backbone_stages(values: dict, level: str) -> None:
    """The shrunk layer count leaves out_features naming a stage the fewer layers lack: let the config
    derive stage_names / out_features / out_indices from the layer count again."""
    for key in ("stage_names", "out_features", "out_indices"):
        values.pop(key, None)


CONFIG_FIXES.update({"dinov3_vit": _backbone_stages, "sapiens2": _backbone_stages})


def _moonshine_streaming(values: dict, level: str) -> None:
    """Its default decoder config has no num_key_value_heads, which the decoder reads: the default config
    does not build at all. Give it one (= num_attention_heads, as the encoder config has)."""
    values.setdefault("num_key_value_heads", values["num_attention_heads"])


def _glm4v_rope(values: dict, level: str) -> None:
    """GLM-4.1V's checkpoints rotate half the head (partial_rotary_factor 0.5: 64 of 128 dims, the 32 frequencies
    mrope_section [8, 12, 12] splits); the default config leaves the factor out, so its rotary module builds 64
    frequencies that [8, 12, 12] cannot split (glm4v/modeling_glm4v.py:485). Give it the checkpoints' factor."""
    text = values.get("text_config", values)
    text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.5}
    _vision_out_to_text(values)


def _vision_out_to_text(values: dict, towers: tuple[str, ...] = ("vision_config",)) -> None:
    """Each tower's out_hidden_size is the text width (zoo's shrink narrows the text only)."""
    for tower in towers:
        if tower in values and "text_config" in values and "out_hidden_size" in values[tower]:
            values[tower]["out_hidden_size"] = values["text_config"]["hidden_size"]


def _glm4v_moe_rope(values: dict, level: str) -> None:
    """GLM-4.5V: 96 heads of 4096 give head_dim 42 by hidden/heads, 11 rotary frequencies with the default
    partial_rotary_factor 0.5, which mrope_section [8, 12, 12] cannot split; the checkpoint's head is 128 wide.
    This config has no head_dim field, so make hidden_size = heads * 128."""
    text = values.get("text_config", values)
    text["hidden_size"] = text["num_attention_heads"] * 128
    _vision_out_to_text(values)


def _hunyuan_vl_rope(values: dict, level: str) -> None:
    """HunYuanVL's text rotary reads rope_parameters['mrope_section'] (len() of it in forward), which the
    default config lacks; HunyuanOCR's checkpoint has xdrope_section [16, 16, 16, 16] (head_dim 128)."""
    text = values.get("text_config", values)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [16, 16, 16, 16]}
    _vision_out_to_text(values)


def _qwen3_omni_head(values: dict, level: str) -> None:
    """Qwen3-Omni thinker text: 2048 / 28 heads gives 73 by hidden/heads while the rotary uses another split;
    the checkpoint has head_dim 128. Give the text config head_dim 128."""
    text = values["text_config"]
    text["head_dim"] = 128
    _vision_out_to_text(values)
    # get_rope_index (qwen3_omni_moe/modeling_qwen3_omni_moe.py:219) finds images after vision_start_token_id,
    # which the default thinker config does not define (the checkpoint's is 151652): give it free ids
    # outside the random text range 4..215 and the shrunk special ids (225, 240, 244, 252)
    values["vision_start_token_id"] = 230
    values["vision_end_token_id"] = 231


def _deepseek_v2_topk(values: dict, level: str) -> None:
    """DeepSeek-V2's default config has num_experts_per_tok None, which its router passes to topk."""
    values["num_experts_per_tok"] = 2


def _zamba2_mamba(values: dict, level: str) -> None:
    """Zamba2 ties n_mamba_heads * mamba_headdim to mamba_expand * hidden_size; zoo's shrink knows the
    mamba_n_heads / mamba_d_head spelling only, so narrow the head dim to the shrunk width."""
    values["mamba_headdim"] = values["mamba_expand"] * values["hidden_size"] // values["n_mamba_heads"]
    # its shared attention block runs on [hidden, original embeddings]: twice the width, head dim kept
    values["attention_hidden_size"] = 2 * values["hidden_size"]
    values["attention_head_dim"] = values["attention_hidden_size"] // values["num_attention_heads"]
    # hybrid_layer_ids index the 54 default layers: derive them again from the kept layers_block_type
    values["hybrid_layer_ids"] = [i for i, kind in enumerate(values["layers_block_type"]) if kind == "hybrid"]


def _step3p7_window(values: dict, level: str) -> None:
    """Step3p7's text model builds a sliding-window mask for every forward, and its default config has
    sliding_window None (every layer is full attention, so the value is not used)."""
    values["text_config"]["sliding_window"] = 4096


def _glm_image_vq(values: dict, level: str) -> None:
    """GLM-Image's VQ model quantizes the vision tower's features: its latent_channels is the vision width."""
    _glm4v_rope(values, level)
    values["vq_config"]["latent_channels"] = values["vision_config"]["hidden_size"]
    # the VQ codes are scattered into input_ids and embedded by the text vocabulary, shrunk to 256
    values["vq_config"]["num_embeddings"] = min(values["vq_config"]["num_embeddings"], values["text_config"]["vocab_size"])


CONFIG_FIXES.update({
    "moonshine_streaming": _moonshine_streaming,
    **{t: _glm4v_rope for t in ("glm46v", "glm4v", "glmga", "glm4v_text", "glm_image", "glm_image_text")},
    **{t: _glm4v_moe_rope for t in ("glm4v_moe", "glm4v_moe_text")},
    **{t: _hunyuan_vl_rope for t in ("hunyuan_vl", "hunyuan_vl_text")},
    "qwen3_omni_moe_thinker": _qwen3_omni_head,
    "deepseek_v2": _deepseek_v2_topk,
    "zamba2": _zamba2_mamba,
    "step3p7": _step3p7_window,
    "glm_image": _glm_image_vq,
})


# -- shrunk configs their own validate_architecture refuses ---------------------------------------------


def _molmo2_feature_layers(values: dict, level: str) -> None:
    """Molmo2's adapter reads ViT layers 24 and 18 of the default tower, which the shrunk one (2 layers) lacks:
    read its last two."""
    values["adapter_config"]["vision_feature_layer"] = [-1, -2]


def _muse_spark_audio_out(values: dict, level: str) -> None:
    """Muse Spark scatters its audio encoder's output onto the text embeddings: its out_hidden_size is the text
    width (the vision tower's too)."""
    _vision_out_to_text(values, ("audio_config", "vision_config"))


def _dots3_note_adapter(values: dict, level: str) -> None:
    """Dots3's vision and audio adapters map their tower's hidden states onto the text embeddings: in, the
    (shrunk) tower width; out, the text width."""
    for tower, into in (("vision_config", "adapter_in_dim"), ("audio_config", "adapter_input_size")):
        values[tower][into] = values[tower]["hidden_size"]
        values[tower]["adapter_out_dim"] = values["text_config"]["hidden_size"]


def _apertus1p5_vocabulary(values: dict, level: str) -> None:
    """Apertus 1.5 embeds image and audio codes as text tokens: image codes from image_token_offset, audio codes
    right after them, all within the text vocabulary, which a 256-token vocabulary does not reach (nor keeps
    small at the default offsets, 262k). Put 64 codes of each after the 256 text tokens."""
    values["vision_config"]["codebook_size"] = values["audio_config"]["codebook_size"] = 64
    values["image_token_offset"], values["audio_token_offset"] = 256, 320
    values["text_config"]["vocab_size"] = 384
    # Its VQ image tokenizer is a convolutional encoder of 256 base channels (182M parameters): 32 and one
    # residual block per stage keep it within the sweep's size; it holds no RoPE.
    values["vision_config"]["base_channels"], values["vision_config"]["num_res_blocks"] = 32, 1


def _dory_segments(values: dict, level: str) -> None:
    """Dory splits its layers into input, recurrent and output segments that must add up to the layer count,
    and its serialized config lists each layer as an (attention, "mlp") pair that loading halves
    (dory/configuration_dory.py), which zoo's shrink does not keep: three layers, one per segment, in pairs."""
    kinds = ["sliding_attention", "sliding_attention", "full_attention"]
    values["layer_types"] = [block for kind in kinds for block in (kind, "mlp")]
    values["num_hidden_layers"] = 2 * len(kinds)
    values["n_input_layers"] = values["n_recurrent_layers"] = values["n_output_layers"] = 2


def _kolibri_indexed_layers(values: dict, level: str) -> None:
    """Kolibri 1.1's index_layers, kv_source_layers and mlp_only_layers index the 30 default layers: let the
    config derive them again from the kept layer_types. Its indexer's 12 heads must fit in the query heads
    that share a key head (2 once shrunk)."""
    for key in ("index_layers", "kv_source_layers", "mlp_only_layers"):
        values.pop(key, None)
    values["index_num_heads"] = values["num_attention_heads"] // values["num_key_value_heads"]


CONFIG_FIXES.update({
    "molmo2": _molmo2_feature_layers,
    "muse_spark": _muse_spark_audio_out,
    "dots3_note": _dots3_note_adapter,
    "apertus1p5": _apertus1p5_vocabulary,
    "dory": _dory_segments,
    "kolibri1_1": _kolibri_indexed_layers,
    "llava_onevision1_5": lambda values, level: _vision_out_to_text(values),
})
