"""Runner / FlexibleRunner: build everything from config or live objects, then run the loops.

The runner owns no training logic: it builds the model, data, optimizer wrapper, schedulers, hooks
and loops, sets the model up through the connector (precision, memory techniques, then the
strategy's wrapping: :func:`memfit.connector.setup`), and saves/restores the state a resume needs.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memfit import dist
from memfit.checks import check_classes, check_eval_configs
from memfit.data.batch_sampler import batch_size_of
from memfit.errors import ConfigError, ConfigTypeError, Preempted, did_you_mean, warn_ignored
from memfit.hooks.base import Hook
from memfit.hooks.log_options import log_options
from memfit.hooks.registration import RunnerHooks
from memfit.log_dir import make_log_dir
from memfit.logger import MessageHub, get_logger, log_failure
from memfit.model.base import BaseModel
from memfit.registry import MODELS, copy_cfg
from memfit.resume import RunnerCheckpoints


class Runner(RunnerCheckpoints, RunnerHooks):
    """MMEngine's Runner API on memfit. Pass live objects or config dicts (see MMEngine's guides)."""

    def __init__(
        self,
        model: nn.Module | dict,
        work_dir: str,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
        train_cfg: dict | None = None,
        val_cfg: dict | None = None,
        test_cfg: dict | None = None,
        auto_scale_lr: dict | None = None,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        val_evaluator: Any = None,
        test_evaluator: Any = None,
        default_hooks: dict | None = None,
        custom_hooks: list | None = None,
        data_preprocessor: dict | None = None,
        load_from: str | None = None,
        resume: bool | str = False,
        launcher: str | None = None,
        env_cfg: dict | None = None,
        log_processor: dict | None = None,
        log_level: str = "INFO",
        visualizer: Any = None,
        default_scope: str | None = None,
        randomness: dict | None = None,
        experiment_name: str | None = None,
        strategy: Any = None,
        compile: bool | dict = False,
        cfg: dict | None = None,
        precision: dict | None = None,  # Apex/VISSL opt levels: dict(opt_level='O2', ...), memfit.precision.master
    ) -> None:
        from memfit.config.schema import CONFIG_KEYS, TestCfg, TrainCfg, ValCfg
        from memfit.precision import precision_options

        self.cfg = dict(cfg or {})
        for key in self.cfg:
            if key not in CONFIG_KEYS and not key.startswith("_"):
                raise ConfigError(f"cfg: unknown key {key!r}: {did_you_mean(key, CONFIG_KEYS)}")
        self.work_dir = Path(work_dir).resolve()
        self.experiment_name = experiment_name
        self._train_cfg = TrainCfg.from_dict(train_cfg, "train_cfg") if train_cfg is not None else None
        # Checked here too (not only in configs): a typo in val_cfg/test_cfg fails in the Python API as well.
        self._val_cfg = ValCfg.from_dict(val_cfg, "val_cfg") if val_cfg is not None else None
        self._test_cfg = TestCfg.from_dict(test_cfg, "test_cfg") if test_cfg is not None else None
        self._train_dataloader_cfg, self._val_dataloader_cfg = train_dataloader, val_dataloader
        self._test_dataloader_cfg = test_dataloader
        self._optim_wrapper_cfg, self._param_scheduler_cfg = optim_wrapper, param_scheduler
        self._val_evaluator_cfg, self._test_evaluator_cfg = val_evaluator, test_evaluator
        self._auto_scale_lr = auto_scale_lr
        check_eval_configs(val=(val_dataloader, val_evaluator, val_cfg),
                           test=(test_dataloader, test_evaluator, test_cfg))
        self.load_from, self.resume_from = load_from, resume
        self.compile, self._precision = compile, precision_options(precision)
        self.launcher = dist.resolve_launcher(launcher)
        self._setup_environment(strategy, env_cfg, randomness, work_dir, log_level)
        self.model: nn.Module = self._build_model(model, data_preprocessor)
        self.optim_wrapper: Any = None
        self.param_schedulers: list = []
        self.train_loop: Any = None
        self.val_loop: Any = None
        self.test_loop: Any = None
        self.train_dataloader = self.val_dataloader = self.test_dataloader = None
        self._prepared = False
        self._hooks: list[Hook] = []
        self._register_hooks(log_options(default_hooks, log_processor, visualizer, train_cfg, self.cfg), custom_hooks)
        if default_scope is not None:  # MMEngine's registry scope, e.g. 'mmdet'
            warn_ignored(f"default_scope={default_scope!r}", "no registry scopes; type= is a name, class or path")
        monitor = self.cfg.get("memory_monitor")
        if monitor:
            self.register_hook({"type": "MemoryMonitorHook", **(monitor if isinstance(monitor, dict) else {})},
                               key="memory_monitor")
        self._cfg_to_dump: dict | None = None

    def _setup_environment(self, strategy: Any, env_cfg: dict | None, randomness: dict | None, work_dir: str,
                           log_level: str) -> None:
        """The process group and device first (the strategy's), then the seeds, then the log folder and logger."""
        from memfit.config.schema import EnvCfg, Randomness
        from memfit.logger import check_log_level
        from memfit.strategies import build_strategy

        check_log_level(log_level)
        env = EnvCfg.from_dict(env_cfg, "env_cfg")
        if strategy is None:
            strategy = self._strategy_from_cfg()
        # Launched as several processes with no strategy: data parallel, as MMEngine does.
        launched = int(os.environ.get("WORLD_SIZE", 1)) if self.launcher != "none" else 1
        self.strategy = build_strategy(strategy, launched)
        self.strategy.setup_env(self.launcher, {"dist_cfg": env.dist_cfg, "cudnn_benchmark": env.cudnn_benchmark})
        self.randomness = Randomness.from_dict(randomness, "randomness")
        self.seed = self._set_seed(self.randomness)
        self.timestamp = dist.broadcast_object(time.strftime("%Y%m%d_%H%M%S"))
        self.log_dir = self.work_dir / self.timestamp
        if dist.is_main_process():
            make_log_dir(self.work_dir, self.timestamp, work_dir)
        self.logger = get_logger(self.log_dir / f"{self.timestamp}.log" if dist.is_main_process() else None,
                                 log_level)
        self.message_hub = MessageHub()
        self.logger.info(f"memfit: torch {torch.__version__}, {type(self.strategy).__name__} on {self.device}, "
                         f"world size {dist.get_world_size()}, seed {self.seed}")

    @staticmethod
    def _build_model(model: nn.Module | dict, data_preprocessor: dict | None) -> nn.Module:
        if isinstance(model, dict) and data_preprocessor is not None:
            model = {**model, "data_preprocessor": data_preprocessor}
        built = MODELS.build(model, key="model")
        if not isinstance(built, nn.Module):
            raise ConfigTypeError(f"model must be an nn.Module or a config dict, got {type(built).__name__}")
        return built

    # -- construction from a config ------------------------------------------------------------
    @classmethod
    def from_cfg(cls, cfg: Any) -> Runner:
        """Build a runner from a config (``Config`` or dict): top-level keys are the arguments."""
        from memfit.config.schema import HELPER_KEYS, RUNNER_KEYS, TECHNIQUE_KEYS, validate_config

        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        validate_config(cfg)
        if "work_dir" not in cfg:
            raise ConfigError("work_dir is not set: add work_dir='./work_dirs/NAME' or pass --work-dir")
        fitted = None
        if cfg.get("auto_fit"):  # the fastest predicted plan within the budget (memfit.planner.autofit)
            from memfit.planner.autofit import apply_auto_fit

            cfg, fitted = apply_auto_fit(cfg, cfg["auto_fit"])
        kwargs = {k: copy_cfg(v) for k, v in cfg.items() if k in RUNNER_KEYS and k != "cfg"}
        kwargs["cfg"] = {**(cfg.get("cfg") or {}), **{k: cfg[k] for k in TECHNIQUE_KEYS + HELPER_KEYS if k in cfg}}
        kwargs["cfg"].pop("auto_fit", None)
        kwargs["cfg"].pop("planner", None)
        runner = cls(**kwargs)
        if "fp16" in cfg:  # MMDetection's DINO Swin-L config still sets it
            warn_ignored(f"fp16={cfg['fp16']!r}", "it is MMDetection 2's switch, which MMEngine's Runner does not read "
                         "either (that run trains in fp32): for mixed precision set optim_wrapper=dict("
                         "type='AmpOptimWrapper', loss_scale='dynamic')")
        if fitted:
            runner.logger.info(fitted)
        runner._cfg_to_dump = cfg
        return runner

    def _strategy_from_cfg(self) -> Any:
        wrapper = self.cfg.get("model_wrapper_cfg")
        if wrapper is None:
            return None
        from memfit.strategies import strategy_from_model_wrapper

        return strategy_from_model_wrapper(wrapper)

    # -- properties hooks read ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def epoch(self) -> int:
        return self.train_loop.epoch if self.train_loop is not None else 0

    @property
    def iter(self) -> int:
        return self.train_loop.iter if self.train_loop is not None else 0

    @property
    def max_epochs(self) -> int:
        return self.train_loop.max_epochs if self.train_loop is not None else 0

    @property
    def max_iters(self) -> int:
        return self.train_loop.max_iters if self.train_loop is not None else 0

    @property
    def train_loop_by_epoch(self) -> bool:
        return self.train_loop.by_epoch if self.train_loop is not None else True

    @property
    def hooks(self) -> list[Hook]:
        return self._hooks

    # -- seeds ---------------------------------------------------------------------------------
    def _set_seed(self, randomness: Any) -> int:
        seed = randomness.seed
        if seed is None:
            seed = dist.broadcast_object(random.randint(0, 2**31 - 1))
        rank_seed = seed + dist.get_rank() if randomness.diff_rank_seed else seed
        random.seed(rank_seed)
        np.random.seed(rank_seed % 2**32)
        torch.manual_seed(rank_seed)
        if randomness.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        return seed

    # -- building the pieces -----------------------------------------------------------------
    def _build_dataloader(self, cfg: Any, key: str) -> Any:
        from memfit.data import build_dataloader

        return build_dataloader(cfg, seed=self.seed, rank=self.rank, world_size=self.world_size, key=key,
                                device=self.device)

    def _prepare(self, with_optimizer: bool) -> None:
        if self._prepared:
            return
        from memfit.connector import setup

        optim_cfg = self._scaled_optim_cfg() if with_optimizer else None
        if self.train_dataloader is not None:
            self.strategy.set_micro_batch_size(batch_size_of(self.train_dataloader))
        self.model, self.optim_wrapper = setup(
            self.model, self.strategy, optim_cfg, self.cfg, precision=self._precision,
            optimizer_in_backward=bool(self.cfg.get("optimizer_in_backward")) and with_optimizer,
            optimizer_offload=bool(self.cfg.get("optimizer_offload")) and with_optimizer, compile=self.compile)
        self._prepared = True

    def _scaled_optim_cfg(self) -> Any:
        from memfit.optim.builder import scale_lr_cfg

        if self._optim_wrapper_cfg is None:
            raise ConfigError("optim_wrapper is not set: e.g. optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01))")
        return scale_lr_cfg(self._optim_wrapper_cfg, self._auto_scale_lr,
                            lambda: batch_size_of(self.train_dataloader) * self.world_size)

    def _build_eval_loop(self, loader_cfg: Any, evaluator_cfg: Any, loop_cfg: Any, mode: str) -> Any:
        from memfit.evaluator import Evaluator
        from memfit.loops import EvalLoop

        if loader_cfg is None or evaluator_cfg is None or loop_cfg is None:  # all None: check_eval_configs
            return None
        loader = self._build_dataloader(loader_cfg, f"{mode}_dataloader")
        setattr(self, f"{mode}_dataloader", loader)
        fp16 = bool(getattr(loop_cfg, "fp16", False))
        evaluator = Evaluator(evaluator_cfg, dataset_size=len(loader.dataset) if hasattr(loader, "dataset") else None,
                              key=f"{mode}_evaluator")
        evaluator.dataset_meta = getattr(getattr(loader, "dataset", None), "metainfo", None)
        return EvalLoop(self, loader, evaluator, mode=mode, fp16=fp16)

    # -- entry points --------------------------------------------------------------------------
    def train(self) -> nn.Module:
        """Train as configured (resuming or loading weights first); returns the model."""
        from memfit.data.loader import close_workers
        from memfit.loops import TrainLoop
        from memfit.optim.scheduler import build_param_schedulers

        if self._train_cfg is None or self._train_dataloader_cfg is None:
            raise ConfigError("train() needs train_dataloader and train_cfg (e.g. dict(by_epoch=True, max_epochs=10))")
        tc = self._train_cfg
        self.train_dataloader = self._build_dataloader(self._train_dataloader_cfg, "train_dataloader")
        self.train_loop = TrainLoop(self, self.train_dataloader, by_epoch=tc.by_epoch, max_epochs=tc.max_epochs,
                                    max_iters=tc.max_iters, val_interval=tc.val_interval, val_begin=tc.val_begin)
        self.val_loop = self._build_eval_loop(self._val_dataloader_cfg, self._val_evaluator_cfg, self._val_cfg, "val")
        check_classes(self.model, train_dataloader=self.train_dataloader, val_dataloader=self.val_dataloader)
        for hook in self._hooks:  # what a hook can check once the loops exist, before anything is written
            if hasattr(hook, "check_loops"):
                hook.check_loops(self)
        if isinstance(self.model, BaseModel) and not (self._prepared or getattr(self.strategy, "skip_init_weights", 0)):
            self.model.init_weights()  # init_cfg (e.g. Pretrained); load_from / resume load over it
        self._prepare(with_optimizer=True)
        loop = self.train_loop
        self.param_schedulers = build_param_schedulers(
            self._param_scheduler_cfg, self.optim_wrapper, by_epoch_run=tc.by_epoch, max_epochs=loop.max_epochs,
            max_iters=loop.max_iters, epoch_length=loop.iters_per_epoch)
        self._dump_config()
        self._load_or_resume()
        self.call_hook("before_run")
        finished = False
        try:
            self.train_loop.run()
            finished = True
        except Preempted:  # not a failure: the checkpoint to resume from is written and logged
            raise
        except BaseException as exc:  # one line where it failed; the traceback to the log file
            log_failure(self.logger, exc, "training", self.train_loop.position())
            raise
        finally:
            try:  # a pending async checkpoint becomes the last one only once written
                self.strategy.finalize_checkpoints(abort=not finished)
            finally:
                self.call_hook("after_run")
                close_workers(self.train_dataloader, self.val_dataloader)
        return self.model

    def val(self) -> dict:
        """Run the validation loop once (loading ``load_from`` first when set)."""
        return self._evaluate("val")

    def test(self) -> dict:
        """Run the test loop once (loading ``load_from`` first when set)."""
        return self._evaluate("test")

    def _evaluate(self, mode: str) -> dict:
        loop = self._build_eval_loop(getattr(self, f"_{mode}_dataloader_cfg"),
                                     getattr(self, f"_{mode}_evaluator_cfg"), getattr(self, f"_{mode}_cfg"), mode)
        if loop is None:
            raise ConfigError(f"{mode}() needs {mode}_dataloader, {mode}_evaluator and {mode}_cfg")
        setattr(self, f"{mode}_loop", loop)
        self._prepare(with_optimizer=False)
        if self.load_from:
            self.load_weights(self.load_from)
        self.call_hook("before_run")
        try:
            return loop.run()
        except BaseException as exc:
            log_failure(self.logger, exc, mode)
            raise
        finally:
            self.call_hook("after_run")

    # -- the resolved config -------------------------------------------------------------------
    def _dump_config(self) -> None:
        if self._cfg_to_dump is None or not dist.is_main_process():
            return
        from memfit.config import dump_config

        dump_config(self._cfg_to_dump, self.log_dir / "config.py")

# MMEngine's large-model training guide imports FlexibleRunner; it is the same engine (it always took ``strategy=``).
FlexibleRunner = Runner
