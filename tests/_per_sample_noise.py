"""Makes two processes with batch 1 train what one process with batch 2 trains (tests/test_fine_tune_multiprocess.py):
each sample's noise and timestep depend only on the sample (its file and the epoch), the VAE latents are the
distribution's mean, and the trainer dumps its trained parameters at the end (``params_<process index>.pt`` in the
folder ``now["out"]``). Installed in the test's own process (one process) and in the launched ones (two)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch


def install(now: dict) -> Callable[[], None]:
    """Patches the DDPM objective's draws, the loop's loss and the trainer's end; returns what undoes it."""
    import library.objectives.ddpm as O
    import library.run.train_step as T
    from library.run import loop
    from library.run.trainer import Trainer

    make_example, batch_loss, finish = O.make_example, loop.batch_loss, Trainer.finish

    def fixed_noise_example(cfg, latents, schedule, generator=None, *, timesteps=None, noise=None):
        return make_example(cfg, latents, schedule, generator, timesteps=timesteps, noise=now["noise"])

    def per_sample_loss(m, batch, generator, *, timesteps=None):
        seeds = [zlib.crc32(f"{p}/{batch.epoch}".encode()) for p in batch.image_paths]
        with torch.no_grad():
            batch.latents = m.parts.vae.encode(batch.pixels).latent_dist.mean * m.family.vae_scale
        shape = batch.latents.shape[1:]
        now["noise"] = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
        return T.batch_loss(m, batch, generator, timesteps=torch.tensor([s % 1000 for s in seeds]))

    def finish_and_dump(self):
        params = [p.detach().clone() for p in self.params]
        torch.save(params, now["out"] + f"/params_{self.acc.process_index}.pt")
        return finish(self)

    O.make_example, loop.batch_loss, Trainer.finish = fixed_noise_example, per_sample_loss, finish_and_dump

    def undo() -> None:
        O.make_example, loop.batch_loss, Trainer.finish = make_example, batch_loss, finish

    return undo
