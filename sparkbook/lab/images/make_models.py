"""Make the lab's tiny random-weight models offline, inside the new vLLM image (torch, transformers, tokenizers).

usage: python make_models.py OUT_DIR
Writes OUT_DIR/hyv4-tiny (HYV4ForCausalLM, only vllm >= 0.32 registers it) and OUT_DIR/qwen3-tiny
(Qwen3ForCausalLM, what the old deployment serves), sharing one ByteLevel BPE tokenizer (vocab 2048,
ChatML) trained on the Python standard library's sources.
"""
import glob
import os
import re
import shutil
import sys
import sysconfig
import time

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 2045, 2046, 2047
BOS = PAD = 2045
EOS = 2047
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
TOKEN_IDS = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def make_tokenizer(out: str) -> None:
    """Train the byte-level BPE on local text and save it with the ChatML template."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.add_special_tokens(SPECIALS)
    ids = [tok.token_to_id(s) for s in SPECIALS]
    assert tok.get_vocab_size() == VOCAB and ids == [BOS, 2046, EOS], (tok.get_vocab_size(), ids)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0], model_max_length=4096)
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    GenerationConfig(**TOKEN_IDS).save_pretrained(out)


def hyv4_config():
    """The HY V4 config that serves on the CPU (dense MLA, head 576; see notes/lab-facts.md)."""
    cfg = CONFIG_MAPPING["hy_v4"](
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention", "full_attention"], index_topk=64, index_head_dim=128, index_n_heads=2,
        indexer_types=["full", "shared"], hc_mult=2, max_position_embeddings=4096, tie_word_embeddings=False,
        **TOKEN_IDS)
    cfg.architectures = ["HYV4ForCausalLM"]
    return cfg


def qwen3_config():
    """A tiny Qwen3 config (hidden 128, 2 layers)."""
    cfg = CONFIG_MAPPING["qwen3"](
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True, **TOKEN_IDS)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def hyv4_key(key: str) -> str:
    """transformers' saved name -> the original HY layout vLLM's hy_v4 loader expects (else NaN output)."""
    key = re.sub(r"\.hc_pre\.(hc_attn_layer|hc_mlp_layer)\.hc_", r".\1.hc_pre.hc_", key)
    key = re.sub(r"\.(mlp|shared_experts)\.linear_gate\.", r".\1.gate_proj.", key)
    return re.sub(r"^model\.hc_pre\.hc_head\.hc_head_", "model.hc_head.hc_head_", key)


def make_model(out: str, cfg, tokdir: str, rename=None) -> None:
    """Save a seeded random model for ``cfg`` with the shared tokenizer files."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if rename:
        path = os.path.join(out, "model.safetensors")
        tensors = {rename(k): v.contiguous() for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    for name in os.listdir(tokdir):
        shutil.copy(os.path.join(tokdir, name), out)
    print(out, sorted(os.listdir(out)), flush=True)


def main(root: str) -> None:
    t0 = time.time()
    tokdir = os.path.join(root, "tokenizer")
    make_tokenizer(tokdir)
    make_model(os.path.join(root, "hyv4-tiny"), hyv4_config(), tokdir, rename=hyv4_key)
    make_model(os.path.join(root, "qwen3-tiny"), qwen3_config(), tokdir)
    print(f"models made in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
