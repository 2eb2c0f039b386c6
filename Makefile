# microvm: the two commands a new user runs are `make demo` and `make test` (README.md).
# Everything else is a step they depend on. Artifacts land in build/ (git-ignored); the kernel
# build, vhost-device-vsock and virtiofsd are cached outside the repo in $(MICROVM_CACHE).

MICROVM_CACHE ?= /var/cache/microvm
export MICROVM_CACHE
CARGO ?= cargo
BUILD := $(CURDIR)/build

.PHONY: all deps kernel initrd initrd-hostile guests build test lint demo bench bench-density soak fuzz clean

all: build kernel initrd guests

deps:
	scripts/install-deps.sh

kernel: deps
	kernel-config/build.sh

initrd: deps
	guest-agent/build-initrd.sh

# The agent with its HOSTILE TEST HOOKS (guest-agent/src/hostile.rs), for the hostile-agent pod
# tests only: build/initrd-hostile.cpio, never the product initrd.
initrd-hostile: deps
	guest-agent/build-initrd.sh --hostile-test-hooks

guests: deps
	$(MAKE) -C tests/guests OUT=$(BUILD)/guests

build: deps
	$(CARGO) build --release --workspace --bins

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) clippy --manifest-path fuzz/Cargo.toml --release --all-targets -- -D warnings

# No `build`: scripts/run-tests.sh builds the binaries itself, with the features its tests turn on
# (one build instead of two).
test: deps kernel initrd initrd-hostile guests
	scripts/run-tests.sh

demo: deps kernel initrd guests build
	scripts/demo.sh

bench: deps kernel initrd guests build
	scripts/bench.sh

# The long density run (not in CI; docs/benchmarks.md): pods until BENCH_DENSITY_MAX run or the
# node's memory is nearly used, on this host and, where its KVM cannot boot our guest, in the lane.
BENCH_DENSITY_MAX ?= 500
bench-density: deps kernel initrd guests build
	BENCH_DENSITY_MAX=$(BENCH_DENSITY_MAX) scripts/bench.sh

# The long soak (not in CI; make test runs the short one): 1,000 container cycles in one pod and 300
# pod cycles on each backend, sampled as they go, CSV in build/soak (docs/benchmarks.md, "Soak").
soak: deps kernel initrd guests build
	scripts/soak.sh

# Every coverage-guided fuzz target for FUZZ_SECONDS each (docs/fuzzing.md): one line per target
# with its executions, coverage and crashes. CI runs only the short smoke (scripts/fuzz-smoke.sh).
FUZZ_SECONDS ?= 600
fuzz: deps
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

clean:
	rm -rf $(BUILD)
	$(CARGO) clean
