// `pathways._pathways`: the C++ client library as a Python extension. Torch-free on this side:
// arrays cross as bytes (one copy each way) and the Python package (pathways/__init__.py) turns
// them into torch tensors. Every call that waits releases the GIL; every Status becomes an
// exception of the package's hierarchy, chosen by its code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "core/process.h"
#include "tools/flags.h"
#include "train/trainer.h"

namespace py = pybind11;

namespace pathways {
namespace {

// A Status on its way to Python: the translator below raises the exception class for its code.
struct StatusError {
  absl::Status status;
};

[[noreturn]] void Raise(const absl::Status& status) { throw StatusError{status}; }

template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

// Waits for a future with the GIL released, in slices, so that Ctrl-C (SIGINT, which Python turns
// into a pending KeyboardInterrupt) stops the wait without touching the cluster. The GIL is taken
// back by hand: a thread that takes it while the interpreter shuts down is ended by Python with a
// forced unwind, which must not pass through a destructor; such a thread (a daemon still waiting)
// stays parked instead, and the process exits around it.
// The result is moved out of the future when the caller kept no copy (a fetched array is not
// copied again).
void RetakeGil(PyThreadState* state) {
  if (_Py_IsFinalizing()) {
    for (;;) absl::SleepFor(absl::Hours(1));
  }
  PyEval_RestoreThread(state);
}

template <typename T>
T Wait(Future<T> future) {
  while (true) {
    PyThreadState* state = PyEval_SaveThread();
    const bool ready = future.WaitFor(absl::Milliseconds(100));
    RetakeGil(state);
    if (ready) return Value(std::move(future).Take());
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Runs `fn` with the GIL released and takes it back by hand (RetakeGil), as Wait does: a daemon
// thread whose call returns while the interpreter shuts down stays parked rather than be ended by
// a forced unwind through gil_scoped_release's destructor (which aborted the process at exit).
template <typename F>
auto WithoutGil(F&& fn) -> decltype(fn()) {
  PyThreadState* state = PyEval_SaveThread();
  auto retake = [state] { RetakeGil(state); };
  if constexpr (std::is_void_v<decltype(fn())>) {
    try {
      fn();
    } catch (...) {
      retake();
      throw;
    }
    retake();
  } else {
    std::optional<decltype(fn())> result;
    try {
      result.emplace(fn());
    } catch (...) {
      retake();
      throw;
    }
    retake();
    return *std::move(result);
  }
}

// Python callbacks of futures run on this thread, one at a time: never on a runtime thread (a
// device's, an RPC's), which would then wait for the GIL while Python code runs.
ThreadPool& CallbackThread() {
  static auto* pool = new ThreadPool("py-callbacks", 1);  // never destroyed: used until exit
  return *pool;
}

// Calls `fn` (a Python callable of no arguments) once `future` completes, whatever its result,
// on CallbackThread. Nothing runs once the interpreter is finalizing: the callable is then left
// unreleased, as it cannot be released without the GIL.
void CallWhenReady(const Future<Unit>& future, py::function fn) {
  auto* held = new py::function(std::move(fn));
  future.OnReady(CallbackThread(), [held](const absl::StatusOr<Unit>&) {
    if (_Py_IsFinalizing()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    try {
      (*held)();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("pathways: a callback of Array.on_ready");
    }
    delete held;
    PyGILState_Release(gil);
  });
}

TensorSpec Spec(const std::string& dtype, const Shape& shape) { return {Value(ParseDType(dtype)), shape}; }

std::vector<TensorSpec> Specs(const std::vector<std::pair<std::string, Shape>>& specs) {
  std::vector<TensorSpec> out;
  for (const auto& [dtype, shape] : specs) out.push_back(Spec(dtype, shape));
  return out;
}

std::pair<std::string, Shape> FromSpec(const TensorSpec& spec) { return {DTypeName(spec.dtype), spec.shape}; }

// A client and what keeps it valid: the embedded cluster it was connected to, if any, lives at
// least as long as the client. Each call holds the client for its duration, so closing it from
// one thread while another calls (or a trainer steps) ends the client once they are done.
class PyClient {
 public:
  PyClient(std::shared_ptr<LocalCluster> cluster, std::unique_ptr<Client> client)
      : cluster_(std::move(cluster)), client_(std::move(client)) {}
  std::shared_ptr<Client> get() const {
    absl::MutexLock lock(&mu_);
    if (client_ == nullptr) Raise(absl::FailedPreconditionError("this client is closed"));
    return client_;
  }
  void Close() {
    std::shared_ptr<Client> client;
    {
      absl::MutexLock lock(&mu_);
      client = std::move(client_);
    }
  }

 private:
  const std::shared_ptr<LocalCluster> cluster_;
  mutable absl::Mutex mu_;
  std::shared_ptr<Client> client_ ABSL_GUARDED_BY(mu_);
};

// A fetched array's bytes, for Python's buffer protocol: the tensor a fetch returns shares them.
struct FetchedBytes {
  explicit FetchedBytes(HostArray a) : array(std::move(a)) {}  // for make_shared (clang 14 has no paren aggregates)
  HostArray array;
};

struct PyArray {
  ShardedArray array;
  std::shared_ptr<PyClient> client;
  // Ready()'s future, made at the first is_ready() or ready() and polled after.
  mutable std::optional<Future<Unit>> ready;
  // Set once a fetch returned or raised: a fetch waits on a future of its own, which the Ready()
  // future polled by is_ready() may not have heard of yet. Read and written with the GIL held.
  mutable bool settled = false;
  Future<Unit> Ready() const {
    if (!ready) ready = client->get()->Ready(array);
    return *ready;
  }
};

// Waits for `future` (a fetch) of array `a`, and marks the array settled once the wait ends with
// a result or the array's error (not when Ctrl-C ends it).
template <typename T>
T WaitSettling(const PyArray& a, Future<T> future) {
  try {
    T value = Wait(std::move(future));
    a.settled = true;
    return value;
  } catch (const StatusError&) {
    a.settled = true;
    throw;
  }
}

FunctionSpec ScriptSpec(const std::string& name, const std::string& source,
                        const std::vector<std::pair<std::string, Shape>>& inputs,
                        const std::vector<std::pair<std::string, Shape>>& outputs,
                        const std::vector<PartitionSpec>& in_shardings, const std::vector<PartitionSpec>& out_shardings,
                        const std::vector<int>& donated, const std::string& source_file) {
  FunctionSpec spec = FunctionSpec::Script(name, source, Specs(inputs), Specs(outputs), in_shardings, out_shardings);
  spec.donated_inputs = donated;
  spec.body.source_file = source_file;
  return spec;
}

std::vector<ShardedArray> Unwrap(const std::vector<std::shared_ptr<PyArray>>& arrays) {
  std::vector<ShardedArray> out;
  for (const auto& a : arrays) out.push_back(a->array);
  return out;
}

std::vector<std::shared_ptr<PyArray>> Wrap(std::vector<ShardedArray> arrays, const std::shared_ptr<PyClient>& client) {
  std::vector<std::shared_ptr<PyArray>> out;
  for (ShardedArray& a : arrays) out.push_back(std::make_shared<PyArray>(PyArray{std::move(a), client}));
  return out;
}

}  // namespace
}  // namespace pathways

PYBIND11_MODULE(_pathways, m) {
  using namespace pathways;
  m.doc() = "The pathways C++ client library (internal: use the `pathways` package).";
  // Every mutex in this process is the runtime's: absl's lock-order (deadlock) detection, on by
  // default in Debian's build, would cost every future and promise a global graph update (the
  // island scheduler's FIFO path ran 24x slower with it: bench/scheduler_bench.cc). Serving
  // processes turn it off the same way (InitServingProcess); a client of a remote cluster too.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Exceptions: the package maps each status code to its class (pathways/errors.py).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const absl::string_view text = e.status.message();
      py::object message = py::reinterpret_steal<py::object>(
          PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace"));
      py::object cls = py::module_::import("pathways.errors").attr("from_code")(static_cast<int>(e.status.code()));
      py::object exc = cls(message);
      exc.attr("code") = static_cast<int>(e.status.code());
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::class_<PyClient, std::shared_ptr<PyClient>>(m, "Client")
      .def("id", [](PyClient& c) { return c.get()->id(); })
      .def("describe", [](PyClient& c) { return WithoutGil([&] { return Value(c.get()->DescribeCluster()); }); })
      .def("create_slice",
           [](PyClient& c, std::vector<int64_t> mesh, std::vector<std::string> axes, std::optional<int> island,
              bool span_islands) {
             return WithoutGil([&] {
               return Value(c.get()->CreateSlice(
                   {.mesh_shape = mesh, .axis_names = axes, .island = island, .span_islands = span_islands}));
             });
           })
      .def("put",
           [](std::shared_ptr<PyClient> c, py::buffer data, const std::string& dtype, Shape shape,
              const VirtualSlice& slice, PartitionSpec spec) {
             py::buffer_info info = data.request();
             const TensorSpec s = Spec(dtype, shape);
             const int64_t bytes = Value(ByteSize(s.dtype, s.shape));
             if (info.size * info.itemsize != bytes) {
               Raise(absl::InvalidArgumentError(absl::StrCat("put: ", info.size * info.itemsize, " bytes for ",
                                                             s.ToString(), ", which takes ", bytes)));
             }
             HostArray host =
                 Value(HostArray::FromBytes(s.dtype, s.shape, std::string(static_cast<const char*>(info.ptr), bytes)));
             return WithoutGil([&] {
               return std::make_shared<PyArray>(PyArray{Value(c->get()->Put(std::move(host), slice, spec)), c});
             });
           })
      .def(
          "compile",
          [](PyClient& c, const std::string& name, const std::string& source,
             const std::vector<std::pair<std::string, Shape>>& inputs,
             const std::vector<std::pair<std::string, Shape>>& outputs, const std::vector<PartitionSpec>& in_shardings,
             const std::vector<PartitionSpec>& out_shardings, const std::vector<int>& donated,
             std::optional<std::vector<int>> vjp_wrt, bool vjp_with_outputs, const std::string& source_file) {
            FunctionSpec spec =
                ScriptSpec(name, source, inputs, outputs, in_shardings, out_shardings, donated, source_file);
            if (vjp_wrt) spec = Value(FunctionSpec::Vjp(spec, *vjp_wrt, vjp_with_outputs));
            return WithoutGil([&] { return Value(c.get()->Compile(spec)); });
          },
          py::arg("name"), py::arg("source"), py::arg("inputs"), py::arg("outputs"), py::arg("in_shardings"),
          py::arg("out_shardings"), py::arg("donated"), py::arg("vjp_wrt") = std::nullopt,
          py::arg("vjp_with_outputs") = false, py::arg("source_file") = "")
      .def(
          "compile_split_vjp",
          [](PyClient& c, const std::string& name, const std::string& source,
             const std::vector<std::pair<std::string, Shape>>& inputs,
             const std::vector<std::pair<std::string, Shape>>& outputs, const std::vector<PartitionSpec>& in_shardings,
             const std::vector<PartitionSpec>& out_shardings, const std::vector<int>& wrt,
             const std::string& source_file) {
            FunctionSpec primal =
                ScriptSpec(name, source, inputs, outputs, in_shardings, out_shardings, {}, source_file);
            FunctionSpec::SplitVjp split = Value(FunctionSpec::VjpKeepingResiduals(primal, wrt));
            return WithoutGil([&] {
              return std::make_pair(Value(c.get()->Compile(split.forward)), Value(c.get()->Compile(split.backward)));
            });
          },
          py::arg("name"), py::arg("source"), py::arg("inputs"), py::arg("outputs"), py::arg("in_shardings"),
          py::arg("out_shardings"), py::arg("wrt"), py::arg("source_file") = "")
      .def("call",
           [](std::shared_ptr<PyClient> c, const CompiledFunction& f, const VirtualSlice& slice,
              const std::vector<std::shared_ptr<PyArray>>& args) {
             std::vector<ShardedArray> in = Unwrap(args);
             std::vector<ShardedArray> out = WithoutGil([&] { return Value(c->get()->Call(f, slice, in)); });
             return Wrap(std::move(out), c);
           })
      .def("run",
           [](std::shared_ptr<PyClient> c, const Program& p, const std::vector<std::shared_ptr<PyArray>>& args) {
             std::vector<ShardedArray> in = Unwrap(args);
             std::vector<ShardedArray> out = WithoutGil([&] { return Value(c->get()->Run(p, in)); });
             return Wrap(std::move(out), c);
           })
      .def("describe_lowering",
           [](PyClient& c, const Program& p, const std::vector<std::shared_ptr<PyArray>>& args) {
             std::vector<ShardedArray> in = Unwrap(args);
             return WithoutGil([&] { return Value(c.get()->DescribeLowering(p, in)); });
           })
      .def("write_trace",
           [](PyClient& c, const std::string& path) { WithoutGil([&] { Check(c.get()->WriteTrace(path)); }); })
      .def("close", [](PyClient& c) { WithoutGil([&] { c.Close(); }); });

  py::class_<FetchedBytes, std::shared_ptr<FetchedBytes>>(m, "FetchedBytes", py::buffer_protocol())
      .def("__len__", [](const FetchedBytes& b) { return b.array.bytes().size(); })
      .def_buffer([](FetchedBytes& b) {
        return py::buffer_info(b.array.mutable_bytes().data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.array.bytes().size())}, {1});
      });

  py::class_<PyArray, std::shared_ptr<PyArray>>(m, "Array")
      .def_property_readonly("id", [](const PyArray& a) { return a.array.id().value(); })
      .def_property_readonly("spec", [](const PyArray& a) { return FromSpec(a.array.spec()); })
      .def_property_readonly("sharding", [](const PyArray& a) { return a.array.sharding().spec(); })
      .def_property_readonly("slice", [](const PyArray& a) { return a.array.slice(); })
      .def_property_readonly("client", [](const PyArray& a) { return a.client; })
      .def("fetch",
           [](const PyArray& a) {
             // The fetched bytes, without a copy: torch.frombuffer shares them (core.py).
             return std::make_shared<FetchedBytes>(WaitSettling(a, a.client->get()->Fetch(a.array)));
           })
      .def("ready", [](const PyArray& a) { Wait(a.Ready()); })  // the future is_ready() polls
      .def("on_ready", [](const PyArray& a, py::function fn) { CallWhenReady(a.Ready(), std::move(fn)); })
      .def("is_ready", [](const PyArray& a) { return a.settled || a.Ready().IsReady(); })
      .def("__repr__", [](const PyArray& a) { return a.array.ToString(); });

  py::class_<VirtualSlice>(m, "Slice")
      .def_property_readonly("id", [](const VirtualSlice& s) { return s.id().value(); })
      .def_property_readonly("mesh_shape", [](const VirtualSlice& s) { return s.mesh().dims; })
      .def_property_readonly("axes", [](const VirtualSlice& s) { return s.mesh().axis_names; })
      .def_property_readonly("num_devices", &VirtualSlice::num_devices)
      .def("__repr__", &VirtualSlice::ToString);

  py::class_<CompiledFunction>(m, "CompiledFunction")
      .def_property_readonly("name", &CompiledFunction::name)
      .def_property_readonly("outputs", [](const CompiledFunction& f) {
        std::vector<std::pair<std::string, Shape>> out;
        for (const TensorSpec& s : f.spec().outputs) out.push_back(FromSpec(s));
        return out;
      });

  py::class_<TracedValue>(m, "TracedValue").def_property_readonly("spec", [](const TracedValue& v) {
    return FromSpec(v.spec());
  });
  py::class_<ProgramBuilder>(m, "ProgramBuilder")
      .def(py::init<std::string>())
      .def("arg", [](ProgramBuilder& b, const std::string& dtype, Shape shape) { return b.Arg(Spec(dtype, shape)); })
      .def("call",
           [](ProgramBuilder& b, const CompiledFunction& f, const VirtualSlice& slice,
              const std::vector<TracedValue>& in) { return Value(b.Call(f, slice, in)); })
      .def("build", [](ProgramBuilder& b, const std::vector<TracedValue>& results) { return Value(b.Build(results)); });
  py::class_<Program>(m, "Program")
      .def_property_readonly("name", &Program::name)
      .def("ir", &Program::ToString)
      .def_property_readonly("num_calls", [](const Program& p) { return p.calls().size(); });

  py::class_<LocalCluster, std::shared_ptr<LocalCluster>>(m, "LocalCluster")
      .def(py::init([](int islands, int hosts_per_island, int devices_per_host, int64_t device_memory,
                       int64_t dcn_latency_us, double dcn_gbps, const std::string& function_ops) {
             const DeviceBackend backend =
                 Value(DeviceBackend::Create("cpu", "", Value(ParseFunctionOps(function_ops))));
             // Serving in this process: the settings servers need (descriptors, the allocator).
             InitServingProcess();
             return WithoutGil([&] {
               return std::shared_ptr<LocalCluster>(
                   Value(LocalCluster::Start({.num_islands = islands,
                                              .hosts_per_island = hosts_per_island,
                                              .devices_per_host = devices_per_host,
                                              .device_memory_bytes = device_memory,
                                              .dcn = {.latency = absl::Microseconds(dcn_latency_us), .gbps = dcn_gbps},
                                              .backend = backend})));
             });
           }),
           py::arg("islands"), py::arg("hosts_per_island"), py::arg("devices_per_host"), py::arg("device_memory"),
           py::arg("dcn_latency_us") = 0, py::arg("dcn_gbps") = 0.0, py::arg("function_ops") = "vetted")
      .def_property_readonly("address", &LocalCluster::controller_address);

  m.def("connect_local", [](std::shared_ptr<LocalCluster> cluster) {
    return WithoutGil([&] {
      std::unique_ptr<Client> client = Value(cluster->Connect());
      return std::make_shared<PyClient>(std::move(cluster), std::move(client));
    });
  });
  m.def(
      "connect",
      [](const std::string& address, std::optional<std::string> token) {
        return WithoutGil([&] {
          return std::make_shared<PyClient>(nullptr, Value(Client::Connect(address, {.token = std::move(token)})));
        });
      },
      py::arg("address"), py::arg("token") = py::none());
  m.def("parse_bytes", [](const std::string& text) { return Value(ParseBytes(text)); });

  // For bench/python_bench.py: the loops the Python benchmark times, written in C++ against the
  // same client, so that Python's cost is measured against C++'s in one run.
  m.def("bench_chain_of_calls", [](PyClient& c, const CompiledFunction& f, const VirtualSlice& slice,
                                   const std::shared_ptr<PyArray>& first, int calls) {
    return WithoutGil([&] {
      ShardedArray x = first->array;
      const absl::Time start = absl::Now();
      for (int i = 0; i < calls; ++i) x = Value(c.get()->Call(f, slice, {x}))[0];
      (void)Value(c.get()->Fetch(x).Await());
      return absl::ToDoubleSeconds(absl::Now() - start);
    });
  });
  m.def("bench_put_and_fetch", [](PyClient& c, const VirtualSlice& slice, int64_t bytes) {
    return WithoutGil([&] {
      HostArray data = Value(HostArray::Create(DType::kF32, {bytes / 4}));
      const absl::Time start = absl::Now();
      ShardedArray a = Value(c.get()->Put(data, slice));
      (void)Value(c.get()->Ready(a).Await());  // the put is timed until its data is on the device
      const absl::Time put = absl::Now();
      Future<HostArray> fetched = c.get()->Fetch(a);
      (void)fetched.Await();
      (void)Value(std::move(fetched).Take());  // moved out once ready, as Python's fetch does
      return std::make_pair(absl::ToDoubleSeconds(put - start), absl::ToDoubleSeconds(absl::Now() - put));
    });
  });

  // The Transformer trainer (train/trainer.h), as `pathways train` drives it.
  // Holds the Client it trains on alive (Trainer keeps a reference); refuses to step once the
  // Python client is closed.
  struct PyTrainer {
    std::shared_ptr<PyClient> py_client;
    std::shared_ptr<Client> client;
    std::unique_ptr<Trainer> trainer;
    Trainer& get() {
      (void)py_client->get();  // FailedPrecondition once closed
      return *trainer;
    }
  };
  py::class_<Future<double>>(m, "LossFuture", "The future of a training step's mean loss (nats).")
      .def("result", [](const Future<double>& f) { return Wait(f); },
           "Waits for the step (Ctrl-C stops the wait) and returns its loss, or raises why it failed.")
      .def("done", &Future<double>::IsReady, "Whether the step has finished (or failed), without waiting.");
  py::class_<PyTrainer, std::shared_ptr<PyTrainer>>(m, "Trainer")
      .def(py::init([](std::shared_ptr<PyClient> client, const std::string& model, int64_t batch, int64_t seq_len,
                       int64_t vocab, int64_t data_parallel, int64_t tensor_parallel, int64_t pipeline_stages,
                       int64_t microbatches, int islands, int64_t seed, double learning_rate,
                       const std::string& text_file, const std::string& resume_from, bool recompute) {
             TrainOptions o;
             o.model = Value(TransformerPreset(model));
             if (seq_len != 0) o.model.seq_len = seq_len;  // 0: the preset's; a negative one is refused
             if (vocab != 0) o.model.vocab = vocab;
             o.model.init_seed = static_cast<uint64_t>(seed);
             o.data_seed = static_cast<uint64_t>(seed) + 1;  // as `pathways train --seed`
             o.batch = batch;
             o.layout = {.data = data_parallel, .tensor = tensor_parallel, .stages = pipeline_stages};
             o.microbatches = microbatches;
             o.islands = islands;
             o.adam.learning_rate = learning_rate;
             o.text_file = text_file;
             o.resume_from = resume_from;
             o.recompute = recompute;
             auto t = std::make_shared<PyTrainer>();
             t->client = client->get();
             t->py_client = std::move(client);
             t->trainer = WithoutGil([&] { return Value(Trainer::Create(*t->client, o)); });
             return t;
           }),
           py::arg("client"), py::arg("model"), py::arg("batch"), py::arg("seq_len"), py::arg("vocab"),
           py::arg("data_parallel"), py::arg("tensor_parallel"), py::arg("pipeline_stages"), py::arg("microbatches"),
           py::arg("islands"), py::arg("seed"), py::arg("learning_rate"), py::arg("text_file"), py::arg("resume_from"),
           py::arg("recompute") = false)
      .def("step", [](PyTrainer& t) { return WithoutGil([&] { return Value(t.get().Step()); }); })
      .def("save", [](PyTrainer& t, const std::string& path) { WithoutGil([&] { Check(t.get().Save(path)); }); })
      .def_property_readonly("entropy", [](const PyTrainer& t) { return t.trainer->entropy(); })
      .def_property_readonly("tokens_per_step", [](const PyTrainer& t) { return t.trainer->tokens_per_step(); })
      .def_property_readonly("steps_done", [](const PyTrainer& t) { return t.trainer->steps_issued(); })
      .def_property_readonly("description", [](const PyTrainer& t) { return t.trainer->model().config.ToString(); });
}
