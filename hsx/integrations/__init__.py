"""Trainer integrations: exports of a job's output in SpecForge, speculators and ModelOpt formats, and
the SpecForge feed that streams a running job into SpecForge's training loop. Part of the base install:
they import the SDK only; the trainers' own packages (torch, pyarrow, mooncake, yaml) are imported where
the writers and the feed run."""
