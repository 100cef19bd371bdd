"""Prompt-line syntax, prompt files (.txt/.toml/.json), errors naming file and line, sampling triggers, flags."""

from __future__ import annotations

import argparse
import json

import pytest

from library.cli.parse import ConfigError
from library.sampling import (
    PromptSpec,
    SampleConfig,
    add_sample_args,
    parse_prompt_line,
    read_prompt_file,
    should_sample,
)

# (line, expected fields): every option of the syntax, alone and combined.
LINES = [
    ("a cat", {"prompt": "a cat"}),
    ("a cat --n blurry, low quality", {"prompt": "a cat", "negative_prompt": "blurry, low quality"}),
    ("a cat --w 832 --h 1216", {"width": 832, "height": 1216}),
    ("a cat --d 42", {"seeds": (42,)}),
    ("a cat --d 1,2,3", {"seeds": (1, 2, 3)}),
    ("a cat --l 6.5", {"scale": 6.5}),
    ("a cat --s 28", {"steps": 28}),
    ("a cat --ss euler_a", {"sampler": "euler_a"}),
    ("a cat --ss K_DPM_2_A", {"sampler": "k_dpm_2_a"}),
    ("a cat --ss ddpm", {"sampler": "ddpm"}),
    ("a cat --am 0.5,1", {"network_multipliers": (0.5, 1.0)}),
    ("a cat --f out.png", {"file_name": "out.png"}),
    ("a cat --ow 2048 --oh 1024", {"original_width": 2048, "original_height": 1024}),
    ("a cat --nw 512 --nh 256", {"original_width_negative": 512, "original_height_negative": 256}),
    ("a cat --ct 16 --cl 32", {"crop_top": 16, "crop_left": 32}),
    ("a cat --g 3.5", {"guidance": 3.5}),  # FLUX.1 dev's embedded guidance (SD/SDXL ignore it when sampling)
    ("a cat --W 512 --H 768", {"width": 512, "height": 768}),  # option names are case-insensitive
    (
        "masterpiece, (a cat:1.2) --n blurry --w 832 --h 1216 --d 42 --l 6.5 --s 28 --ss dpmsolver++",
        {
            "prompt": "masterpiece, (a cat:1.2)",
            "negative_prompt": "blurry",
            "width": 832,
            "height": 1216,
            "seeds": (42,),
            "scale": 6.5,
            "steps": 28,
            "sampler": "dpmsolver++",
        },
    ),
]


@pytest.mark.parametrize("line,expected", LINES)
def test_prompt_line_options(line, expected):
    spec = parse_prompt_line(line)
    defaults = PromptSpec(prompt=expected.get("prompt", "a cat"))
    for field in defaults.__dataclass_fields__:
        want = expected.get(field, getattr(defaults, field))
        assert getattr(spec, field) == want, field


# (line, words the error must contain)
BAD_LINES = [
    ("a cat --x 3", ["unknown option --x"]),
    ("a cat --ww 512", ["unknown option --ww", "did you mean --w"]),
    ("a cat --w abc", ["--w", "'abc' is not an integer"]),
    ("a cat --h 513", ["--h", "513 must be a multiple of 8", "try 512"]),
    ("a cat --w 32", ["--w", "at least 64"]),
    ("a cat --s 0", ["--s", "1 to 1000"]),
    ("a cat --l high", ["--l", "not a number"]),
    ("a cat --ss eulr_a", ["unknown sampler 'eulr_a'", "did you mean 'euler_a'"]),
    ("a cat --d", ["--d needs a value"]),
    ("a cat --t 0.5", ["img2img"]),
    ("a cat --nl 5", ["negative scale"]),
    ("a cat --dsd1 3", ["Deep Shrink"]),
    ("a cat --g -3.5", ["--g", "must be a finite number >= 0, got -3.5"]),
    ("a cat --g inf", ["--g", "must be a finite number >= 0, got inf"]),
]


@pytest.mark.parametrize("line,words", BAD_LINES)
def test_bad_prompt_line_names_file_and_line(tmp_path, line, words):
    path = tmp_path / "prompts.txt"
    path.write_text(f"# samples\n\na good prompt --w 512\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        read_prompt_file(path)
    message = str(e.value)
    assert f"{path}:4" in message
    for word in words:
        assert word in message


def test_every_bad_line_reported_at_once(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("ok\na --w 12x\nb --q 1 --h 100\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        read_prompt_file(path)
    assert len(e.value.problems) == 3
    assert f"{path}:2" in e.value.problems[0] and f"{path}:3" in e.value.problems[2]


def test_txt_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# title\n\n  a cat --d 1\n   # indented comment\nsecond prompt --s 5\n", encoding="utf-8")
    specs = read_prompt_file(path)
    assert [(s.prompt, s.index) for s in specs] == [("a cat", 0), ("second prompt", 1)]
    assert specs[0].seed == 1 and specs[1].steps == 5


def test_toml_defaults_merged_into_subsets(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        "[prompt]\nnegative_prompt = 'bad'\nwidth = 640\nsample_steps = 12\nscale = 5.0\n"
        "[[prompt.subset]]\nprompt = 'one'\nseed = 7\n"
        "[[prompt.subset]]\nprompt = 'two'\nwidth = 768\nsample_sampler = 'euler'\nnegative_prompt = ''\n",
        encoding="utf-8",
    )
    one, two = read_prompt_file(path)
    assert one == PromptSpec("one", "bad", width=640, seeds=(7,), scale=5.0, steps=12, index=0)
    assert two == PromptSpec("two", "", width=768, scale=5.0, steps=12, sampler="euler", index=1)


def test_toml_errors_name_the_entry(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[prompt]\n[[prompt.subset]]\nprompt = 'a'\nwidht = 512\nheight = 100\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        read_prompt_file(path)
    text = str(e.value)
    assert "prompt.subset[0]: unknown key 'widht'; did you mean 'width'?" in text
    assert "prompt.subset[0]: height: 100 must be a multiple of 8" in text


def test_json_lines_and_tables(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(["a cat --w 512", {"prompt": "a dog", "sample_steps": 9, "seed": 3}]))
    a, b = read_prompt_file(path)
    assert (a.prompt, a.width, a.index) == ("a cat", 512, 0)
    assert (b.prompt, b.steps, b.seeds, b.index) == ("a dog", 9, (3,), 1)
    path.write_text(json.dumps(["ok", {"prompt": "x", "width": "wide"}, 5]))
    with pytest.raises(ConfigError, match=r"\[2\] must be a prompt line"):
        read_prompt_file(path)
    path.write_text(json.dumps(["ok", {"prompt": "x", "width": "wide"}]))
    with pytest.raises(ConfigError, match=r"\[1\]: width: 'wide' is not an integer"):
        read_prompt_file(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_prompt_file(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompt_file(tmp_path / "empty.txt")


def test_seed_for_each_image():
    assert PromptSpec("a").seed_for(3) is None
    spec = PromptSpec("a", seeds=(10, 20))
    assert [spec.seed_for(i) for i in range(4)] == [10, 20, 21, 22]


def _args(argv):
    parser = argparse.ArgumentParser()
    add_sample_args(parser)
    return parser.parse_args(argv)


def test_sample_config_validates_up_front(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("a cat --w 512\n")
    cfg = SampleConfig.from_args(_args(["--sample_prompts", str(good), "--sample_every_n_steps", "5"]))
    assert str(cfg.prompts_file) == str(good) and cfg.sampler == "ddim" and cfg.every_n_steps == 5
    assert should_sample(cfg, step=5) and not should_sample(cfg, step=4)
    bad = tmp_path / "bad.txt"
    bad.write_text("a cat --w 500\n")
    with pytest.raises(ConfigError) as e:
        SampleConfig.from_args(_args(["--sample_prompts", str(bad), "--sample_every_n_epochs", "0"]))
    assert len(e.value.problems) == 2 and f"{bad}:1" in str(e.value) and "--sample_every_n_epochs" in str(e.value)
    with pytest.raises(ConfigError, match="--sample_prompts is missing"):
        SampleConfig.from_args(_args(["--sample_at_first"]))
    with pytest.raises(SystemExit):  # argparse rejects an unknown sampler name
        _args(["--sample_sampler", "dpm++_2m_karras"])


@pytest.mark.parametrize(
    "steps,epochs,first,calls,expected",
    [
        # (every_n_steps, every_n_epochs, at_first, [(step, epoch)], [should sample])
        (5, None, False, [(0, 0), (4, None), (5, None), (10, None), (10, 1)], [False, False, True, True, False]),
        (None, 2, False, [(5, None), (10, 1), (20, 2), (30, 3), (40, 4)], [False, False, True, False, True]),
        (5, 2, False, [(5, None), (10, 2)], [False, True]),  # epochs override steps
        (None, None, True, [(0, 0), (5, None), (10, 1)], [True, False, False]),
        (None, None, False, [(0, 0), (5, None)], [False, False]),
    ],
)
def test_should_sample_follows_sd_scripts(tmp_path, steps, epochs, first, calls, expected):
    cfg = SampleConfig(tmp_path / "p.txt", every_n_steps=steps, every_n_epochs=epochs, at_first=first)
    assert [should_sample(cfg, step=s, epoch=e) for s, e in calls] == expected
    assert not should_sample(SampleConfig(None, every_n_steps=1), step=1)


def test_one_guidance_rule_for_training_prompts_and_inference(tmp_path):
    """FLUX's embedded guidance has one range wherever it is given: --guidance_scale in training, a prompt's --g,
    --guidance of gen_img.py and flux_minimal_inference.py (a negative value trained silently before)."""
    import flux_minimal_inference
    import flux_train_network
    import gen_img
    from library.cli.problems import ConfigError
    from library.families.flux.options import FluxOptions

    rule = "must be a finite number >= 0, got -3.5"
    args = flux_train_network.build_parser().parse_args(["--guidance_scale", "-3.5"])
    with pytest.raises(ConfigError, match="--guidance_scale " + rule):
        FluxOptions.from_args(args, training=True)
    with pytest.raises(ConfigError, match="--guidance " + rule):
        gen_img.run(["--ckpt", str(tmp_path), "--prompt", "a", "--guidance", "-3.5"])
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    with pytest.raises(ConfigError, match="--guidance " + rule):
        flux_minimal_inference.run(["--ckpt_path", str(model), "--prompt", "a", "--guidance", "-3.5"])
    FluxOptions.from_args(flux_train_network.build_parser().parse_args(["--guidance_scale", "0"]), training=True)
