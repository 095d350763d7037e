"""Triton `dflash`: the embedded PyTorch DFlash runtime (draft + verify loop) as a decoupled python model.

The request loop (parsing, streaming, cancellation) is trtllm_dflash/serving/engine_model.py, shared with the TensorRT-LLM
backend's `tensorrt_llm` model. Requests are batched in flight: each request thread submits to one engine loop
(trtllm_dflash/engine/scheduler.py) that runs every running request's draft and verify in one forward each, admits
waiting requests into free slots (max_batch_size of them) in arrival order, and publishes what it does as Triton
custom metrics on the metrics port.
"""

import json
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtllm_dflash.config import ENGINE_FILE, EngineOptions
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.engine.scheduler import EngineMetrics
from trtllm_dflash.serving.engine_model import EngineModel

MAX_STREAMS = 1024  # open streams the model accepts; beyond max_batch_size they wait in the scheduler's queue
METRICS_EVERY = 1.0  # seconds between metric updates, as often as tritonserver refreshes its own (--metrics-interval-ms
# defaults to 2000); each update of a metric is a round trip to the server process that holds the GIL
METRICS = EngineMetrics.published()  # name -> (gauge | counter, help): the engine's metrics are the families


class TritonPythonModel(EngineModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        here = Path(args["model_repository"])
        opts = EngineOptions.from_json((here / ENGINE_FILE).read_text(), str(here / ENGINE_FILE))
        self.engine = DFlashEngine.from_options(opts, here, progress=pb_utils.Logger.log_info)
        max_batch = int(config["max_batch_size"])
        max_seq_len = int(config["parameters"]["max_seq_len"]["string_value"])
        # A Metric needs its MetricFamily alive: both are kept for the model's life.
        self.families = {
            k: pb_utils.MetricFamily(f"dflash_{k}", d, pb_utils.MetricFamily.GAUGE)
            if kind == "gauge"
            else pb_utils.MetricFamily(f"dflash_{k}_total", d, pb_utils.MetricFamily.COUNTER)
            for k, (kind, d) in METRICS.items()
        }
        self.metrics = {k: family.Metric(labels={"model": "dflash"}) for k, family in self.families.items()}
        self.block_family = pb_utils.MetricFamily(
            "dflash_block_length_steps_total",
            "Requests' steps per chosen block length (each running request counts once per engine step)",
            pb_utils.MetricFamily.COUNTER,
        )
        self.block_counters, self._published = {}, {}
        self._stepped = threading.Event()  # set by the engine thread after every step; the publisher thread clears it
        self.scheduler = self.engine.scheduler(
            max_batch,
            max_seq_len + self.engine.block_size,
            on_step=lambda m: self._stepped.set(),
            log=pb_utils.Logger.log_error,
            prefix_cache_tokens=opts.prefix_cache_tokens,
        )
        self.start(
            name="dflash",
            tokenizer=self.engine.tokenizer,
            max_seq_len=max_seq_len,
            vocab_rows=self.engine.target.vocab_rows,
            max_batch_size=MAX_STREAMS,
        )
        threading.Thread(target=self._publisher, name="dflash-metrics", daemon=True).start()
        pb_utils.Logger.log_info(
            f"dflash ready: block size {self.engine.block_size}, draft {self.engine.draft_weights or 'no'}, "
            f"in-flight batching up to {max_batch} requests, {opts.speculation} speculation"
            f"{', prompt lookup' if self.engine.lookup else ''}"
        )

    def _publisher(self):
        """Publish the engine's metrics after its steps, at most every METRICS_EVERY seconds and only those that changed,
        from a thread of its own: made between steps, the updates took a noticeable share of the engine thread's time
        under load (docs/performance.md#metrics-publisher)."""
        while not self.stopping.is_set():
            if not self._stepped.wait(timeout=1.0):
                continue
            self._stepped.clear()
            try:
                self._publish(self.scheduler.metrics)
            except Exception as e:  # metrics are not worth a stopped publisher
                pb_utils.Logger.log_error(f"dflash: publishing metrics failed: {type(e).__name__}: {e}")
            self.stopping.wait(METRICS_EVERY)

    def _publish(self, m):
        """Engine metrics -> Triton custom metrics: gauges set to their value, counters advanced by what happened since
        the last publish."""
        values = {k: float(getattr(m, k)) for k in METRICS}
        values |= {
            ("block", k): float(steps) for k, steps in dict(m.block_lengths).items()
        }  # a copy: the engine adds keys
        for key, value in values.items():
            last = self._published.get(key)
            if last == value:
                continue
            if key in METRICS and METRICS[key][0] == "gauge":
                self.metrics[key].set(value)
            elif key in METRICS:
                self.metrics[key].increment(value - (last or 0.0))
            else:
                if key not in self.block_counters:
                    self.block_counters[key] = self.block_family.Metric(
                        labels={"model": "dflash", "block_length": str(key[1])}
                    )
                self.block_counters[key].increment(value - (last or 0.0))
            self._published[key] = value

    def steps(self, job, stats, poll):
        return self.engine.stream(
            job.prompt_ids,
            max_new_tokens=job.max_tokens,
            sampling=job.sampling,
            stop_strings=job.stop_strings,
            stop_token_ids=job.stop_token_ids,
            min_tokens=job.min_tokens,
            stats=stats,
            scheduler=self.scheduler,
            poll=poll,
        )

    def finalize(self):
        self.scheduler.stop()
        super().finalize()
