# Set-up and build entry points. `make test` and `make demo` work on a fresh Debian 12 machine.
BUILD_DIR ?= build
JOBS ?= 2
MAKEFLAGS += --no-print-directory
# Exactly what the build uses: compilers and CMake, ccache, Abseil, protobuf and gRPC (with their
# code generators), libtorch with OpenBLAS (without it libtorch falls back to a slow reference
# BLAS), GoogleTest, openssl (a test makes a certificate) and libssl-dev (clients' credentials
# are SHA-256 preimages of their ids) and iproute2 (a test cuts a worker off in network namespaces);
# cpp-httplib (found through pkg-config) for the controller's dashboard and metrics;
# for the Python package, pybind11 and Python's headers, torch for Python (tensors in and out) and
# pytest for its tests; PyYAML for the deployment files' test (deploy/deploy_test.py); tcmalloc
# (gperftools), the executables' allocator (CMakeLists.txt says why).
DEB_PACKAGES := cmake g++ make ccache libabsl-dev libprotobuf-dev protobuf-compiler \
  protobuf-compiler-grpc libgrpc++-dev libtorch-dev libopenblas-dev libgtest-dev openssl libssl-dev iproute2 \
  pybind11-dev python3-dev python3-torch python3-pytest python3-yaml libcpp-httplib-dev pkg-config \
  libgoogle-perftools-dev

.PHONY: deps deps-fuzz deps-bench deps-browser deps-plot deps-slurm deps-container install-packages build test demo install packaged package check-package check-slurm check-container bench collective-bench fuzz sanitize sanitize-thread thread-safety clean

# Installs only the packages that are missing; as root directly, otherwise through sudo.
deps:
	@$(MAKE) install-packages PACKAGES="$(DEB_PACKAGES)"

# The fuzzer also needs clang and its libFuzzer runtime.
deps-fuzz: deps
	@$(MAKE) install-packages PACKAGES="clang libclang-rt-14-dev"

# The systems collective_bench compares against: torch.distributed with Gloo and OpenMPI. Never a
# dependency of `make test`.
deps-bench: deps
	@$(MAKE) install-packages PACKAGES="python3-torch openmpi-bin libopenmpi-dev"

# Headless Chromium for the dashboard's browser test (tests/dashboard_browser_test.cc), which
# `make test` skips, saying so, without it. Never a dependency of `make test`.
deps-browser:
	@$(MAKE) install-packages PACKAGES="chromium"

# Slurm's daemons and commands and munge, for deploy/slurm/check_local.sh (`make check-slurm`).
# Never a dependency of `make test`.
deps-slurm:
	@$(MAKE) install-packages PACKAGES="slurmctld slurmd slurm-client munge"

# podman (with runc) and debootstrap, for deploy/container_check.sh (`make check-container`).
# Never a dependency of `make test`.
deps-container:
	@$(MAKE) install-packages PACKAGES="podman runc debootstrap"

# What tools/plot_trace.py and tools/plot_multitenancy.py draw with. Never a dependency of `make test`.
deps-plot:
	@$(MAKE) install-packages PACKAGES="python3-matplotlib"

install-packages:
	@missing=""; for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "deps: all packages present"; fi

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j$(JOBS)

test: deps build
	cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS) --timeout 300

# Trains a small Transformer language model on an embedded cluster of two islands (data parallel x
# a two-stage pipeline, stage by island, over an emulated data-centre link), well under two minutes.
DEMO_FLAGS ?= --model small --seq-len 32 --steps 1200 --batch 32 --learning-rate 1e-2 --data-parallel 2 \
  --pipeline-stages 2 --microbatches 2 --islands 2 --dcn-latency-us 50 --dcn-gbps 10
demo: deps build
	$(BUILD_DIR)/bin/pathways train $(DEMO_FLAGS)

# The binary, the client library (libpathways_client.so), its headers and a CMake package config
# (find_package(pathways), target pathways::client) and the Python package under PREFIX.
PREFIX ?= /usr/local
install: packaged
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# What install and package ship, and only that (not the tests and benchmarks). A build tree
# configured before the target existed learns it first.
packaged: deps $(BUILD_DIR)/CMakeCache.txt
	cmake -S . -B $(BUILD_DIR) >/dev/null
	cmake --build $(BUILD_DIR) -j$(JOBS) --target packaged

# Debian packages in build/: pathways (binary, library, Python) and pathways-dev (headers, CMake
# files). dpkg-shlibdeps (dpkg-dev) works out the runtime package's library dependencies, on the
# files that CPack picks out with `file` (not in a minimal Debian such as the debian:12 image).
package: packaged
	@$(MAKE) install-packages PACKAGES="dpkg-dev file"
	cd $(BUILD_DIR) && cpack -G DEB

# The packages installed into a clean Debian 12 made by debootstrap, and used there (root, and
# Debian's mirror reachable; about 5 minutes): deploy/clean_debian_check.sh.
check-package: package
	@$(MAKE) install-packages PACKAGES="debootstrap"
	deploy/clean_debian_check.sh $(BUILD_DIR)

# deploy/slurm/pathways.sbatch run by a Slurm cluster made on this machine: slurmctld and a
# slurmd per node, each node in a network namespace of its own (root; about 15 s). SLURM_NODES
# sets how many.
SLURM_NODES ?= 2
check-slurm: build deps-slurm
	deploy/slurm/check_local.sh $(BUILD_DIR) $(SLURM_NODES)

# deploy/Dockerfile built with podman (on a debian:12 made by debootstrap) and a controller, a
# worker and a tenant's job run as containers of the image (root; about 25 minutes).
check-container: deps-container
	deploy/container_check.sh

bench: deps build
	$(BUILD_DIR)/bin/opbyop_bench

# Collectives against torch.distributed+Gloo and OpenMPI over TCP (about 20 minutes). Configures
# again so that the MPI peer is built once MPI is installed.
collective-bench: deps-bench
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD_DIR) -j$(JOBS) --target collective_bench mpi_allreduce_peer
	$(BUILD_DIR)/bin/collective_bench

# libFuzzer over the request decoding and validation paths (src/testing/request_fuzzer.h), built
# with clang and AddressSanitizer in build-fuzz/. FUZZ_SECONDS bounds the run.
FUZZ_SECONDS ?= 60
fuzz: deps-fuzz
	cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DPATHWAYS_FUZZ=ON
	cmake --build build-fuzz -j$(JOBS) --target request_fuzzer
	mkdir -p build-fuzz/corpus
	build-fuzz/bin/request_fuzzer -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 build-fuzz/corpus

# Every lock annotation checked by clang (-Wthread-safety as an error), then the whole test suite
# under AddressSanitizer and UndefinedBehaviorSanitizer, in build-asan/ (not part of `make test`:
# the build alone takes twice as long).
sanitize: deps-fuzz
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	  -DPATHWAYS_THREAD_SAFETY=ON -DPATHWAYS_SANITIZE=ON
	cmake --build build-asan -j$(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j$(JOBS) --timeout 900

# clang's -Wthread-safety over every source file, as errors, in build-tsa/ (not part of `make test`):
# the lock annotations checked without building or running anything (a syntax pass per file;
# tools/check_thread_safety.py). `make sanitize` checks them too, as it builds.
thread-safety: deps-fuzz
	cmake -S . -B build-tsa -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
	  -DPATHWAYS_THREAD_SAFETY=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
	cmake --build build-tsa -j$(JOBS) --target pw_proto
	tools/check_thread_safety.py build-tsa/compile_commands.json --jobs $(JOBS)

# The whole test suite under ThreadSanitizer, in build-tsan/ (not part of `make test`). It runs
# against Debian's Abseil source built with ThreadSanitizer (tools/tsan/build_abseil.sh says why;
# it fetches the source from Debian's mirror once). tools/tsan/suppressions.txt says why each
# suppression is there. Every process writes its reports to build-tsan/reports/, workers and
# controllers that tests start included, and any report fails the target. OPENBLAS_NUM_THREADS=1:
# otherwise OpenBLAS starts threads before main, where no signal mask reaches, and one of them,
# idle in a condition wait, may take a controller's SIGTERM, which ThreadSanitizer then holds
# until that thread wakes (never). A ctest run by hand in build-tsan/ needs the same environment.
TSAN_DIR := $(CURDIR)/build-tsan
sanitize-thread: deps-fuzz
	@$(MAKE) install-packages PACKAGES="dpkg-dev"
	tools/tsan/build_abseil.sh $(TSAN_DIR)/abseil
	cmake -S . -B $(TSAN_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	  -DPATHWAYS_SANITIZE_THREAD=ON -DPATHWAYS_TSAN_ABSEIL=$(TSAN_DIR)/abseil
	cmake --build $(TSAN_DIR) -j$(JOBS)
	rm -rf $(TSAN_DIR)/reports && mkdir -p $(TSAN_DIR)/reports
	cd $(TSAN_DIR) && TSAN_OPTIONS="suppressions=$(CURDIR)/tools/tsan/suppressions.txt second_deadlock_stack=1 log_path=$(TSAN_DIR)/reports/report" \
	  OPENBLAS_NUM_THREADS=1 ctest --output-on-failure -j$(JOBS) --timeout 1200; status=$$?; \
	if ls reports/report.* > /dev/null 2>&1; then \
	  cat reports/report.*; echo "ThreadSanitizer: reports from $$(ls reports | wc -l) processes (above)"; exit 1; fi; \
	exit $$status

clean:
	rm -rf $(BUILD_DIR) build-fuzz build-asan build-tsan build-tsa
