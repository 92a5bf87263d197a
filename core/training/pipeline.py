"""``specray train-draft``: data -> features -> training -> export, each stage resumable in one output folder.

    OUT/prompts.jsonl, OUT/samples.jsonl    the target's own text (specray.training.data)
    OUT/data.json                           the options and counts it was made with
    OUT/features/                           the target's features and labels (specray.training.features)
    OUT/train/checkpoint.pt                 the head being trained (specray.training.train)
    OUT/head/                               the trained head, public layout, + card.json (its metrics)

Stopped at any point (a session's end), the same command picks up where it stopped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field

from specray.sampling_params import is_int
from specray.training.data import DataConfig
from specray.training.train import TrainConfig

logger = logging.getLogger(__name__)

STAGES = ("data", "features", "train", "export")
DATA_FILE = "data.json"  # the data stage's options and counts, which the head's card reports


@dataclass
class PipelineConfig:
    model: str
    out_dir: str
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stages: tuple[str, ...] = STAGES
    head_dir: str | None = None  # default OUT/head
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError(f"stages={self.stages!r} is empty: nothing would run; give some of {list(STAGES)}")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"stages {unknown} are unknown; choose from {list(STAGES)}")
        threads = self.num_threads
        if threads is not None and (not is_int(threads) or threads < 1):
            raise ValueError(f"num_threads={threads!r} must be an int >= 1 (torch's CPU threads), or None for "
                             "torch's default")

    def make_out_dir(self) -> None:
        """The output folder made, and the head's when the export stage will write it (before any work)."""
        folders = {"out_dir": self.out_dir}
        if "export" in self.stages and self.head_dir is not None:
            folders["head_dir"] = self.head_dir
        for name, folder in folders.items():
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as err:
                raise ValueError(f"{name}={folder!r} cannot be made ({err.strerror}); pass a folder you can "
                                 "write to") from None


def _say(msg: str) -> None:
    logger.warning(msg)


def run(config: PipelineConfig) -> dict:
    """Run the asked stages in order; returns the trained head's held-out metrics (empty before training)."""
    import torch

    from specray.models.loader import load_hf_config, load_model
    from specray.training.data import SAMPLES_FILE, file_prompts, kept_prompts, make_prompts, make_samples, read_jsonl
    from specray.training.features import INDEX_FILE, compute_features
    from specray.training.dflash import export_dflash, train_dflash
    from specray.training.medusa import export_medusa, train_medusa
    from specray.training.mlp_speculator import export_mlp_speculator, train_mlp_speculator
    from specray.training.redrafter import export_redrafter, train_redrafter
    from specray.training.train import CHECKPOINT, export, feature_layers, train

    fit, write = {"medusa": (train_medusa, export_medusa), "redrafter": (train_redrafter, export_redrafter),
                  "mlp_speculator": (train_mlp_speculator, export_mlp_speculator),
                  "dflash": (train_dflash, export_dflash)}.get(config.train.method, (train, export))

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    config.make_out_dir()
    if "data" in config.stages:
        from specray import LLM

        # the folder's prompts, and the prompt file's, checked before the target loads
        (kept_prompts if config.data.prompt_file is None else file_prompts)(config.data, config.out_dir)
        if config.train.method in ("eagle3", "dflash"):  # a target too shallow for their features: said before the data
            feature_layers(config.train.method, load_hf_config(config.model).num_hidden_layers)
        llm = LLM(config.model, max_num_seqs=config.data.max_num_seqs, num_threads=config.num_threads)
        prompts = make_prompts(llm, config.data, config.out_dir,
                               progress=lambda a, b: _say(f"prompts {a}/{b}"))
        made = make_samples(llm, prompts, config.data, config.out_dir,
                            progress=lambda a, b: _say(f"answers {a}/{b}"))
        llm.shutdown()
        del llm
        # the data as it was made, for the head's card (a later command's own data options say nothing of it)
        with open(os.path.join(config.out_dir, DATA_FILE), "w", encoding="utf-8") as f:
            json.dump({**asdict(config.data), "prompts": len(prompts), "samples": len(made)}, f, indent=2)
    metrics: dict = {}
    stages = [s for s in config.stages if s != "data"]
    if not stages:
        return metrics
    samples = read_jsonl(os.path.join(config.out_dir, SAMPLES_FILE))
    if not samples:
        raise ValueError(f"{config.out_dir}/{SAMPLES_FILE} holds no samples: run the 'data' stage first")
    feature_dir = os.path.join(config.out_dir, "features")
    # a later stage asked without what an earlier one leaves: said before the target is loaded
    if "features" not in stages and not os.path.exists(os.path.join(feature_dir, INDEX_FILE)):
        raise ValueError(f"{feature_dir} holds no features: run the 'features' stage first")
    if "train" not in stages and "export" in stages and \
            not os.path.exists(os.path.join(config.out_dir, "train", CHECKPOINT)):
        raise ValueError(f"{config.out_dir}/train holds no {CHECKPOINT}: run the 'train' stage first")
    target_config = load_hf_config(config.model)
    target = load_model(config.model, pack=False)
    layers = feature_layers(config.train.method, target_config.num_hidden_layers)
    if "features" in stages:
        store = compute_features(target, samples, layers, feature_dir,
                                 progress=lambda a, b: _say(f"features {a}/{b}") if a % 50 == 0 or a == b else None)
    if "train" in stages or "export" in stages:
        from specray.training.features import FeatureStore

        store = FeatureStore.open(feature_dir, samples)
        prompt_lens = [s["num_prompt_tokens"] for s in samples[: len(store.lengths)]]
        train_dir = os.path.join(config.out_dir, "train")
        if "train" in stages:
            metrics = fit(target, target_config, store, prompt_lens, config.train, train_dir)
            with open(os.path.join(train_dir, "metrics.json"), "w", encoding="utf-8") as f:
                json.dump(metrics, f, indent=2)
            _say(f"held-out: {json.dumps(metrics)}")
        if "export" in stages:
            head_dir = config.head_dir or os.path.join(config.out_dir, "head")
            write(target, target_config, config.train, train_dir, head_dir)
            metrics_path = os.path.join(train_dir, "metrics.json")
            data_path = os.path.join(config.out_dir, DATA_FILE)
            data = (json.loads(open(data_path, encoding="utf-8").read()) if os.path.exists(data_path)
                    else {"samples": len(samples)})
            card = {"target": os.path.basename(str(config.model)), "method": config.train.method,
                    "train": asdict(config.train), "data": data}
            if os.path.exists(metrics_path):
                card["held_out"] = json.loads(open(metrics_path, encoding="utf-8").read())
            with open(os.path.join(head_dir, "card.json"), "w", encoding="utf-8") as f:
                json.dump(card, f, indent=2)
            _say(f"head written to {head_dir}")
    return metrics
