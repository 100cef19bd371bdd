"""Every entry script and tool reports bad input as one `error:` message with exit status 2 (no traceback) and
leaves its output untouched; messages read as sentences; the console stays readable (log lines above the progress
bar, one process logs, library notices that ask nothing of a user are silenced; DataLoader workers ignore Ctrl-C)."""

from __future__ import annotations

import errno
import io
import logging
import signal

import torch
from _tools_helpers import write_adapter

import gen_img
from library.cli import console as logs
from library.cli.main_guard import main_guard
from networks import check_lora_weights, merge_lora, sdxl_merge_lora


def guarded(capsys, main, *argv):
    """``main(argv)`` as its script's command line runs it: (exit status, the stderr)."""
    code = main_guard(lambda: main([str(a) for a in argv]))
    err = capsys.readouterr().err
    return code, err


def assert_one_error(err: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err


def test_gen_img_input_problems_exit_2(tiny_dir, tmp_path, capsys):
    code, err = guarded(capsys, gen_img.run, "--ckpt", tmp_path / "nope", "--prompt", "x", "--outdir", tmp_path / "o")
    assert code == 2 and "nope: no such file or folder" in err
    assert_one_error(err)
    code, err = guarded(capsys, gen_img.run, "--ckpt", tiny_dir / "sd1", "--prompt", "x", "--outdir", tmp_path / "o",
                        "--vae_batch_size", "2")  # fmt: skip
    assert code == 2 and "--vae_batch_size is not supported yet (the VAE decodes each batch at once)" in err
    code, err = guarded(capsys, gen_img.run, "--ckpt", tiny_dir / "sd1", "--prompt", "x", "--outdir", tmp_path / "o",
                        "--strength", "0.5")  # fmt: skip
    assert code == 2 and "(img2img is not available in gen_img.py)" in err
    assert not (tmp_path / "o").exists()


def test_check_lora_weights_counts_modules_and_keeps_lines_short(tiny_parts, tiny_dir, tmp_path, capsys):
    path = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    assert check_lora_weights.run([str(path)]) is True
    out = capsys.readouterr().out
    modules = len({k.split(".")[0] for k in check_lora_weights.dl.load_adapter(path).state_dict()})
    assert out.startswith(f"number of LoRA modules: {modules} (")
    # a model checkpoint instead of an adapter: a short message, not every key of the model on one line
    model = tiny_dir / "sd1" / "unet" / "diffusion_pytorch_model.safetensors"
    code, err = guarded(capsys, check_lora_weights.run, model)
    assert code == 2 and "is it a model checkpoint?" in err and max(len(line) for line in err.splitlines()) < 1000
    assert_one_error(err)


def test_a_full_disk_while_merging_is_one_message(tiny_parts, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    a = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    (tmp_path / "m.safetensors").write_bytes(b"earlier file")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    code, err = guarded(capsys, merge_lora.run, "--models", a, a, "--save_to", tmp_path / "m.safetensors")
    assert code == 2 and f"{tmp_path / 'm.safetensors'} could not be written (No space left on device)" in err
    assert_one_error(err)
    assert (tmp_path / "m.safetensors").read_bytes() == b"earlier file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "m.safetensors"]  # no temporary file


def test_sdxl_merge_lora_given_an_sd1_model_points_to_merge_lora(tiny_parts, tiny_dir, tmp_path, capsys):
    a = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    code, err = guarded(capsys, sdxl_merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", a, "--save_to",
                        tmp_path / "m.safetensors")  # fmt: skip
    assert code == 2 and "use networks/merge_lora.py" in err and not (tmp_path / "m.safetensors").exists()


def test_an_os_error_reads_as_a_sentence_naming_the_file(tmp_path, capsys):
    def main():
        open(tmp_path)  # a folder: IsADirectoryError

    assert main_guard(main) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: is a directory\n"


# ------------------------------------------------------------------------------------------ the console
def test_log_lines_are_written_above_the_progress_bar():
    from tqdm import tqdm

    stream = io.StringIO()
    handler = logs.TqdmHandler(stream)
    handler.setFormatter(logging.Formatter("INFO %(message)s"))
    logger = logging.getLogger("sdtrain.test_console")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        with tqdm(total=3, file=stream, desc="steps", mininterval=0) as bar:
            bar.update(1)
            logger.info("epoch 2/5")
            bar.update(1)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    assert "INFO epoch 2/5" in lines  # a line of its own, not glued after "steps: 33%|..."


def test_only_the_main_process_writes_info_lines(monkeypatch):
    handler = logs.console_handler(None)
    info = logging.LogRecord("sdtrain", logging.INFO, __file__, 1, "epoch 1/2", None, None)
    warning = logging.LogRecord("sdtrain", logging.WARNING, __file__, 1, "starved bucket", None, None)
    monkeypatch.setenv("RANK", "1")
    assert not handler.filter(info) and handler.filter(warning)
    monkeypatch.setenv("RANK", "0")
    assert handler.filter(info)


def test_library_notices_are_silenced_and_real_warnings_are_not():
    from library.cli.console import library_output

    library_output(False)  # what a run's logging setup does (importing library changes nothing)

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    emitters = [logging.getLogger(n) for n in ("transformers.utils.import_utils", "diffusers.models.modeling_utils")]
    levels = [logger.level for logger in emitters]
    for logger in emitters:
        logger.addHandler(Collect())
        logger.setLevel(logging.WARNING)  # the libraries may have lowered their verbosity in an earlier test
    try:
        emitters[0].warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `...Pil`")
        emitters[1].warning("There are modules in AutoencoderKL that should be kept in float32: ['x']. Casting ...")
        emitters[1].warning("a real problem")
    finally:
        for logger, level in zip(emitters, levels):
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Collect)]
            logger.setLevel(level)
    assert seen == ["a real problem"]


def test_dataloader_workers_ignore_ctrl_c(tmp_path):
    from torch.utils.data import DataLoader, Dataset

    from library.data.loader import ignore_interrupts

    class Handler(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.tensor(int(signal.getsignal(signal.SIGINT) == signal.SIG_IGN))

    loader = DataLoader(Handler(), num_workers=1, worker_init_fn=ignore_interrupts)
    assert [int(x) for x in loader] == [1]


def test_the_training_loader_installs_the_worker_handler(tmp_path):
    from _data_utils import make_png, parse, small_args

    from library.data import build_datasets, make_loader
    from library.data.loader import ignore_interrupts

    make_png(tmp_path / "t" / "1_x" / "a.png", 64, 64)
    plan = build_datasets(parse(small_args(tmp_path / "t")), size_multiple=32)
    assert make_loader(plan, num_workers=1)._loader.worker_init_fn is ignore_interrupts
