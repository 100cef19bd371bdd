"""finetune/make_captions.py (BLIP) and make_captions_by_git.py (GIT) on tiny random transformers models built here
(no download): the caption files hold what the model's own ``generate`` + ``batch_decode`` give for the same images
and settings, and each flag changes what runs."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from finetune import make_captions, make_captions_by_git
from library.data.images import load_image

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "cat", "dog", "on", "the", "with", "words", "sign"]
WORDS += ["red", "picture", "of", "that", "says", "hello", "blue", "sky", "tree", "car", "number", "it", "3"]


def _tokenizer(folder):
    from transformers import BertTokenizer

    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    return BertTokenizer(str(vocab))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny BLIP and GIT models with their processors (PIL image processors, a BERT tokenizer of 26 words)."""
    from transformers import (
        BlipConfig,
        BlipForConditionalGeneration,
        BlipProcessor,
        GitConfig,
        GitForCausalLM,
        GitProcessor,
    )
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    root = tmp_path_factory.mktemp("captioners")
    tokenizer = _tokenizer(root)
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    vision = dict(small, image_size=32, patch_size=16)
    torch.manual_seed(0)
    text = dict(
        small, vocab_size=len(WORDS), max_position_embeddings=64, bos_token_id=2, sep_token_id=3, pad_token_id=0
    )
    blip = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision, projection_dim=16))
    BlipProcessor(BlipImageProcessorPil(size={"height": 32, "width": 32}), tokenizer).save_pretrained(root / "blip")
    blip.save_pretrained(root / "blip")
    git = GitForCausalLM(GitConfig(vision_config=vision, vocab_size=len(WORDS), max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=3, pad_token_id=0, **small))  # fmt: skip
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    GitProcessor(image_processor, tokenizer).save_pretrained(root / "git")
    git.save_pretrained(root / "git")
    return root


@pytest.fixture()
def images(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.jpg", "c.webp", "sub/d.png"):
        pixels = rng.integers(0, 256, size=(40 + len(name), 48, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)
    return folder


def _reference(folder, model_class, names, prompt=None, **generate):
    """Captions from the model's own generate + batch_decode (the oracle), the prompt cut off."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = model_class.from_pretrained(folder).eval()
    text = None if prompt is None else [prompt] * len(names)
    inputs = processor(images=[load_image(str(n)) for n in names], text=text, return_tensors="pt")
    with torch.no_grad():
        tokens = model.generate(**inputs, **generate)
    captions = [c.strip() for c in processor.batch_decode(tokens, skip_special_tokens=True)]
    if prompt is not None:
        assert all(c.startswith(prompt + " ") for c in captions), captions
        captions = [c[len(prompt) :].strip() for c in captions]
    return captions


def test_blip_beam_search_writes_the_models_captions(models, images):
    from transformers import BlipForConditionalGeneration

    written = make_captions.run([str(images), "--caption_weights", str(models / "blip"), "--beam_search",
                                 "--num_beams", "3", "--max_length", "8", "--min_length", "3", "--batch_size", "2"])  # fmt: skip
    names = [images / "a.png", images / "b.jpg", images / "c.webp"]
    expected = _reference(models / "blip", BlipForConditionalGeneration, names, "a picture of", num_beams=3,
                          max_length=8, min_length=3, do_sample=False)  # fmt: skip
    assert sorted(written) == [n.with_suffix(".caption") for n in names]  # not recursive: sub/d.png untouched
    assert [n.with_suffix(".caption").read_text() for n in names] == [c + "\n" for c in expected]
    assert all(expected) and not (images / "sub" / "d.caption").exists()
    # --num_beams changes the search: one beam is greedy decoding
    greedy = make_captions.run([str(images), "--caption_weights", str(models / "blip"), "--beam_search",
                                "--max_length", "8", "--min_length", "3", "--caption_extension", ".greedy"])  # fmt: skip
    assert list(greedy.values()) == _reference(models / "blip", BlipForConditionalGeneration, names, "a picture of",
                                               max_length=8, min_length=3, do_sample=False)  # fmt: skip


def test_blip_sampling_is_seeded_and_flags_apply(models, images):
    base = [str(images), "--caption_weights", str(models / "blip"), "--max_length", "10", "--recursive"]
    first = make_captions.run([*base, "--caption_extention", ".txt"])  # the old spelling still works
    assert sorted(p.name for p in first) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    again = make_captions.run([*base, "--caption_extension", ".again", "--max_data_loader_n_workers", "1"])
    assert list(first.values()) == list(again.values())  # --seed 42 both times, worker loading changes nothing
    other = make_captions.run([*base, "--caption_extension", ".s7", "--seed", "7", "--top_p", "0.5"])
    assert list(other.values()) != list(first.values())
    lengths = [len(c.split()) for c in make_captions.run([*base, "--max_length", "6", "--min_length", "6"]).values()]
    assert max(lengths) == 2  # 6 tokens: the start token, the 3 of the prompt (cut off) and 2 words
    with pytest.raises(ValueError, match="--max_length 4: counts the 4 tokens"):
        make_captions.run([*base, "--max_length", "4", "--min_length", "3"])


def test_git_writes_the_models_captions_and_removes_read_text(models, images):
    from transformers import GitForCausalLM

    written = make_captions_by_git.run([str(images), "--model_id", str(models / "git"), "--max_length", "9",
                                        "--batch_size", "3", "--caption_extension", ".txt"])  # fmt: skip
    names = [images / "a.png", images / "b.jpg", images / "c.webp"]
    assert list(written.values()) == _reference(models / "git", GitForCausalLM, names, max_length=9)
    assert (images / "a.txt").read_text() == written[images / "a.txt"] + "\n"
    cases = {
        'a sign with the words "hello" on it': "a sign",
        "a red car that says hello on it": "a red car",
        "a sky with the number 3 on it": "a sky",
        "a cat": "a cat",
    }
    assert {c: make_captions_by_git.remove_read_text(c) for c in cases} == cases


def test_git_remove_words_changes_the_written_caption(models, images, monkeypatch):
    """--remove_words runs on what GIT wrote (the decoder is made to read a sign)."""
    real = make_captions_by_git.load_transformers_captioner

    def loaded(*args):
        model, processor = real(*args)
        monkeypatch.setattr(
            processor, "batch_decode", lambda tokens, **kw: ["a tree with the words hello"] * len(tokens)
        )
        return model, processor

    monkeypatch.setattr(make_captions_by_git, "load_transformers_captioner", loaded)
    base = [str(images), "--model_id", str(models / "git"), "--max_length", "4"]
    assert set(make_captions_by_git.run(base).values()) == {"a tree with the words hello"}
    assert set(make_captions_by_git.run([*base, "--remove_words"]).values()) == {"a tree"}


def test_bad_input_is_named(models, images, tmp_path, capsys):
    blip = str(models / "blip")
    for argv, needle in [
        ([str(images), "--caption_weights", "https://x/model_large_caption.pth"], "single weights file or URL"),
        ([str(images), "--caption_weights", str(tmp_path)], "no config.json"),
        ([str(images), "--caption_weights", str(models / "git")], "a 'git' model, expected 'blip'"),
        ([str(images), "--caption_weights", blip, "--caption_extension", "txt"], "--caption_extension 'txt'"),
        ([str(images), "--caption_weights", blip, "--top_p", "0"], "--top_p 0.0"),
        ([str(tmp_path / "nothing"), "--caption_weights", blip], "no such folder"),
    ]:
        assert make_captions.main(argv) == 2
        assert needle in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_captions_by_git.main([str(empty), "--model_id", str(models / "git")]) == 2
    assert "no images" in capsys.readouterr().err
    shutil.copy(images / "a.png", empty / "x.png")
    (empty / "y.png").write_bytes(b"not a png")  # a broken image is named and left out
    assert list(make_captions_by_git.run([str(empty), "--model_id", str(models / "git")])) == [empty / "x.caption"]
