# The two commands of the README. Each sets up what it needs (lane environments are
# cached outside the checkout, see .ci/lane).
LANES ?= core triton mindspore xla vllm transformers
# each lane's `opmux check --json` report (written by .ci/test-lane), outside the checkout
export OPMUX_REPORT_DIR ?= $(HOME)/.cache/opmux/reports

.PHONY: demo info test matrix gpu-check bench-llamacpp $(addprefix test-,$(LANES))

demo:  ## the main job: a random Llama checkpoint written here, generated through opmux, checked vs native
	@bash .ci/lane core -- opmux demo

info:
	@bash .ci/lane core -- opmux info

# every lane (all run, so one failure does not hide another's); fails on any failure (pytest
# exit 5 too); then the lanes' reports merged into one op x platform/provider table
test:
	@status=0; for lane in $(LANES); do $(MAKE) --no-print-directory test-$$lane || status=1; done; \
	$(MAKE) --no-print-directory matrix || status=1; exit $$status

# a static pattern rule: make skips implicit rules for .PHONY targets
$(addprefix test-,$(LANES)): test-%:
	@echo "==> lane $*"
	@bash .ci/lane $*

matrix:  ## the platform matrix of the last lane runs; a lane without a report shows as absent
# (the transformers lane writes none: it runs the core lane's providers inside transformers)
	@echo "==> platform matrix ($(OPMUX_REPORT_DIR))"
	@bash .ci/lane core -- python -m opmux.cli matrix --allow-missing \
	  $(foreach lane,$(filter-out transformers,$(LANES)),$(OPMUX_REPORT_DIR)/$(lane).json)

gpu-check:  ## on a CUDA machine: conformance of triton and cuda_c on the GPU, then the GPU benchmark
	@bash .ci/lane triton -- python benchmarks/gpu_kernels.py --check --out $(OPMUX_REPORT_DIR)

# a benchmark lane, not part of `make test`: its environment builds llama.cpp from source once
bench-llamacpp:  ## the main job against llama.cpp and transformers, with the rooflines (CPU)
	@bash .ci/lane llamacpp -- python benchmarks/llamacpp_cpu.py $(BENCH_ARGS)
