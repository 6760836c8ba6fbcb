# The two commands of the README. Each sets up what it needs (lane environments are
# cached outside the checkout, see .ci/lane).
LANES ?= core triton mindspore xla vllm

.PHONY: demo info test $(addprefix test-,$(LANES))

demo:  ## the main job: a random Llama checkpoint written here, generated through opmux, checked against native
	@bash .ci/lane core -- opmux demo

info:
	@bash .ci/lane core -- opmux info

test: $(addprefix test-,$(LANES))  ## every lane; fails on any failure (pytest exit 5 too)

# a static pattern rule: make skips implicit rules for .PHONY targets
$(addprefix test-,$(LANES)): test-%:
	@echo "==> lane $*"
	@bash .ci/lane $*
