"""The tiny models have the real module structure and the real CLIP tokenizer."""

import torch


def test_real_clip_vocabulary(tiny_parts):
    tok = tiny_parts["sd1"].tokenizers[0]
    ids = tok("a photo of a dog", padding="max_length", max_length=77).input_ids
    # ids of the released openai/clip-vit-large-patch14 tokenizer
    assert ids[:7] == [49406, 320, 1125, 539, 320, 1929, 49407]
    assert ids[-1] == 49407  # SD1 pads with <|endoftext|>
    assert tiny_parts["sd2"].tokenizers[0]("a", padding="max_length", max_length=77).input_ids[-1] == 0  # "!"


def test_module_names_match_real_layout(tiny_parts):
    sd1 = dict(tiny_parts["sd1"].denoiser.named_modules())
    assert "down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k" in sd1
    assert "down_blocks.3.resnets.1.conv2" in sd1 and "down_blocks.3.attentions" not in sd1
    assert isinstance(sd1["down_blocks.0.attentions.0.proj_in"], torch.nn.Conv2d)
    sd2 = dict(tiny_parts["sd2"].denoiser.named_modules())
    assert isinstance(sd2["down_blocks.0.attentions.0.proj_in"], torch.nn.Linear)
    xl = dict(tiny_parts["sdxl"].denoiser.named_modules())
    assert "down_blocks.2.attentions.1.transformer_blocks.1.attn1.to_out.0" in xl
    assert "down_blocks.0.attentions" not in xl and "add_embedding.linear_1" in xl


def test_tiny_unet_runs(tiny_parts):
    parts = tiny_parts["sdxl"]
    x = torch.randn(1, 4, 8, 8)
    ctx = torch.randn(1, 77, 80)
    added = {"text_embeds": torch.randn(1, 48), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
    out = parts.denoiser(x, torch.tensor([10]), ctx, added_cond_kwargs=added).sample
    assert out.shape == x.shape and torch.isfinite(out).all()
