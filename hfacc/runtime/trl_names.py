"""TRL's setting names and what each one is in hfacc: the same setting under hfacc's name, or why hfacc has none.

The command line reads this (a TRL name given as a flag or a YAML key is hfacc's setting, or one named error), and
so may any TRL-style front door. The names come from TRL 1.16's configs (``trl/trainer/*_config.py``: the shared
``_BaseConfig``, ``SFTConfig``, ``DPOConfig``, ``RewardConfig``, ``KTOConfig``, ``GRPOConfig``,
``DistillationConfig``; ``trl/trainer/model_config.py``: ``ModelConfig``; ``trl/scripts/utils.py``:
``ScriptArguments``, ``DatasetMixtureConfig``), plus the few that earlier TRL releases had and TRL scripts still
pass (``rpo_alpha``, ``max_prompt_length`` on DPO, ``max_seq_length``). A TRL name that is also an hfacc setting of
the same meaning (``beta``, ``loss_type``, ``max_length``, ``num_generations``, every ``TrainingArguments`` field,
...) is not listed: it is hfacc's own.

    >>> get_hfacc_name("use_peft"), translate_value("truncation_mode", "keep_end")
    ('use_lora', 'left')
    >>> UNSUPPORTED["load_in_4bit"]
    'quantized (bitsandbytes) loading is not available in hfacc.'
"""

from __future__ import annotations

# TRL name -> hfacc name, same meaning.
RENAMED: dict[str, str] = {
    "use_peft": "use_lora",  # ModelConfig
    "dataset_num_proc": "num_proc",
    "dataset_test_split": "dataset_eval_split",  # ScriptArguments
    "dataset_streaming": "streaming",
    "truncation_mode": "truncation",  # values: VALUES below
    "max_seq_length": "max_length",  # SFTConfig before TRL 0.20
    "rpo_alpha": "nll_weight",  # DPOConfig before TRL 1.0: alpha x the chosen answers' NLL, per chosen token
}

# TRL values of a renamed setting that hfacc spells otherwise.
VALUES: dict[str, dict[str, str]] = {
    "truncation_mode": {"keep_start": "right", "keep_end": "left"},  # keep the start: cut the end
}

_LORA = "hfacc's LoRA settings are use_lora, lora_r, lora_alpha, lora_dropout and lora_target_modules"
_TOKENIZER = "set it on the tokenizer and save it (tokenizer.save_pretrained), then pass --tokenizer_name_or_path"
_DPO_LOSSES = "not available in hfacc's DPO (loss_type: sigmoid, ipo, hinge, robust, simpo; nll_weight for RPO)"
_GRPO_LOSS = "not available in hfacc's GRPO family (loss_type, beta, epsilon, epsilon_high, scale_rewards)"
_SAMPLING = "hfacc samples with temperature, top_p, top_k and repetition_penalty only"
_VLLM_SERVER = (
    "hfacc's vLLM server (vllm_mode server, hfacc vllm-serve) takes the weights over HTTP through vLLM's weight-transfer "
    "routes, with no NCCL group, and serves the model vLLM picks"
)
_COMPLETIONS_LOG = "hfacc logs no completions table; the job's summary JSON holds sample answers"
_REF_SYNC = "TR-DPO's reference updates are not available: hfacc's reference model stays frozen"

# TRL name -> why hfacc has no such setting, and what to do instead.
UNSUPPORTED: dict[str, str] = {
    # _BaseConfig / every config
    "model_init_kwargs": "give the model's loading settings as flags: dtype, attn_implementation, "
    "trust_remote_code, model_revision.",
    "router_aux_loss_coef": "set it in the model's config: hfacc adds the router loss the model itself returns.",
    "disable_dropout": "hfacc trains the model as its config says; set the config's dropout to 0 "
    "(`hfacc verify` names dropout as what breaks equivalence).",
    "activation_offloading": "not available; gradient_checkpointing saves activation memory.",
    "pad_to_multiple_of": "this command pads each micro-batch to its longest sequence (padding-free by default).",
    "chat_template_path": f"the chat template is the tokenizer's: {_TOKENIZER}.",
    "eos_token": _TOKENIZER + ".",
    "pad_token": _TOKENIZER + ".",
    # SFTConfig
    "dataset_text_field": "hfacc reads a 'text' column (or 'messages', or 'prompt' and 'completion'): rename "
    "the column, or choose with dataset_format.",
    "dataset_kwargs": "hfacc has no dataset-preparation options; prepare the rows first (datasets.map) and pass the "
    "file or folder.",
    "shuffle_dataset": "the Trainer's sampler shuffles, seeded by data_seed; there is no switch.",
    "packing_strategy": "hfacc packs best-fit decreasing (packing) and lays out padding-free rows itself.",
    "eval_packing": "packing applies to training and evaluation alike.",
    "completion_only_loss": "prompt/completion rows are trained on the completion only, always.",
    "assistant_only_loss": "chat rows are trained on the assistant's turns only, always (read from the chat "
    "template); last_turn_only for the last one.",
    # DPOConfig (and the earlier DPO settings)
    "max_prompt_length": "max_length bounds the prompt and the answer together (as TRL 1.x does); truncation "
    "left cuts the prompt's start.",
    "max_completion_length": "max_length bounds the prompt and the answer together (as TRL 1.x does); truncation "
    "right cuts the answer's end.",
    "loss_weights": _DPO_LOSSES + ".",
    "ld_alpha": _DPO_LOSSES + ".",
    "f_divergence_type": _DPO_LOSSES + ".",
    "f_alpha_divergence_coef": _DPO_LOSSES + ".",
    "use_weighting": _DPO_LOSSES + ".",
    "discopop_tau": _DPO_LOSSES + ".",
    "sync_ref_model": _REF_SYNC + ".",
    "ref_model_mixup_alpha": _REF_SYNC + ".",
    "ref_model_sync_steps": _REF_SYNC + ".",
    # ModelConfig
    "lora_target_parameters": _LORA + ".",
    "lora_modules_to_save": _LORA + ".",
    "lora_task_type": _LORA + ".",
    "use_rslora": _LORA + ".",
    "use_dora": _LORA + ".",
    "load_in_8bit": "quantized (bitsandbytes) loading is not available in hfacc.",
    "load_in_4bit": "quantized (bitsandbytes) loading is not available in hfacc.",
    "bnb_4bit_quant_type": "quantized (bitsandbytes) loading is not available in hfacc.",
    "use_bnb_nested_quant": "quantized (bitsandbytes) loading is not available in hfacc.",
    "bnb_4bit_quant_storage": "quantized (bitsandbytes) loading is not available in hfacc.",
    # ScriptArguments, DatasetMixtureConfig
    "ignore_bias_buffers": "a DDP workaround for boolean buffers that hfacc's trainer does not take.",
    "datasets": "one dataset per run: dataset_name (a file, a folder or a Hub id).",
    "test_split_size": "eval_fraction holds out a share of the training rows.",
    # DistillationConfig
    "teacher_model_revision": "give the teacher as a local folder or a Hub id at its default revision.",
    "teacher_model_init_kwargs": "the teacher is loaded as the student is (dtype, attn_implementation).",
    # GRPOConfig
    "num_generations_eval": "evaluation samples num_generations completions per prompt, as training does.",
    "generation_batch_size": "steps_per_generation sets how many steps one generation serves.",
    "cast_lm_head_to_fp32": "the logits' precision follows the model's (bf16 or fp32); no separate cast.",
    "ds3_gather_for_generation": "DeepSpeed ZeRO-3 generation settings are not available.",
    "min_p": _SAMPLING + ".",
    "generation_kwargs": _SAMPLING + ".",
    "chat_template_kwargs": f"the chat template is the tokenizer's: {_TOKENIZER}.",
    "cache_implementation": _SAMPLING + ".",
    "use_transformers_continuous_batching": "generation is transformers generate or colocated vLLM (use_vllm).",
    "transformers_continuous_batching_config": "generation is transformers generate or colocated vLLM (use_vllm).",
    "use_transformers_paged": "generation is transformers generate or colocated vLLM (use_vllm).",
    "vllm_model_impl": _VLLM_SERVER + ".",
    "vllm_structured_outputs_regex": _SAMPLING + ".",
    "vllm_group_port": _VLLM_SERVER + ".",
    "delta": _GRPO_LOSS + ".",
    "sapo_temperature_neg": _GRPO_LOSS + ".",
    "sapo_temperature_pos": _GRPO_LOSS + ".",
    "vespo_k_pos": _GRPO_LOSS + ".",
    "vespo_lambda_pos": _GRPO_LOSS + ".",
    "vespo_k_neg": _GRPO_LOSS + ".",
    "vespo_lambda_neg": _GRPO_LOSS + ".",
    "importance_sampling_level": _GRPO_LOSS + ".",
    "multi_objective_aggregation": "rewards are summed with reward_weights, then normalized per group.",
    "mask_truncated_completions": _GRPO_LOSS + ".",
    "top_entropy_quantile": _GRPO_LOSS + ".",
    "entropy_coef": _GRPO_LOSS + ".",
    "use_adaptive_entropy": _GRPO_LOSS + ".",
    "entropy_coef_min": _GRPO_LOSS + ".",
    "entropy_coef_max": _GRPO_LOSS + ".",
    "entropy_coef_delta": _GRPO_LOSS + ".",
    "entropy_target": _GRPO_LOSS + ".",
    "off_policy_mask_threshold": _GRPO_LOSS + ".",
    "use_bias_correction_kl": _GRPO_LOSS + ".",
    "max_tool_calling_iterations": "tool calling is GRPO's only in hfacc (GRPOTrainer(tools=...)); this command "
    "samples single turns.",
    "log_completions": _COMPLETIONS_LOG + ".",
    "log_multimodal": _COMPLETIONS_LOG + ".",
    "num_completions_to_print": _COMPLETIONS_LOG + ".",
    "log_unique_prompts": _COMPLETIONS_LOG + ".",
    "log_completions_hub_repo": _COMPLETIONS_LOG + ".",
    # SFTConfig, RewardConfig, KTOConfig: one loss each here (loss_type is a setting of dpo and grpo)
    "loss_type": "this command trains one loss (sft: cross-entropy, TRL's 'nll'; reward: Bradley-Terry; kto: "
    "TRL's 'kto'; distill: the generalized JSD with beta); loss_type is a setting of `hfacc dpo` and `hfacc grpo`.",
    # KTOConfig
    "train_sampling_strategy": "the Trainer's sampler shuffles, seeded by data_seed; there is no switch.",
}


def get_hfacc_name(trl_name: str) -> str | None:
    """hfacc's name for TRL's ``trl_name`` (same meaning), or None when hfacc has no such setting by another name."""
    return RENAMED.get(trl_name)


def translate_value(trl_name: str, value):
    """A value of TRL's ``trl_name`` as hfacc's setting takes it (``keep_end`` -> ``left``); others unchanged."""
    return VALUES.get(trl_name, {}).get(value, value) if isinstance(value, str) else value
