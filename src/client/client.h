// The client library: what a user program links to drive a Pathways cluster from one controller.
//
// Every call returns at once. Arrays returned by Put and Call are futures: they can feed the next
// Call before they are computed, and Fetch/Ready wait for their values. Errors of asynchronous
// work travel to whoever waits on the result.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "array/sharding.h"
#include "compute/function_body.h"
#include "core/future.h"
#include "core/ids.h"
#include "core/types.h"

namespace pathways {

class ClientCore;
class Program;

struct RunOptions {
  enum class Dispatch {
    // Every host sets up all of a run's nodes as soon as the run arrives (paper Figure 4b).
    kParallel,
    // Node k's host-side work starts only once node k-1 is enqueued on every host (Figure 4a),
    // for comparison.
    kSequential,
  };
  Dispatch dispatch = Dispatch::kParallel;
};

struct ClientOptions {
  // The client's share of device time where islands share it proportionally (controller
  // --scheduler share): a client of weight 2 gets twice the device time of one of weight 1.
  double weight = 1;
  // Runs go to the controller over one plain TCP stream (transport/schedule_stream.h) when it
  // offers one, instead of a unary gRPC call per batch. Off: unary calls (benchmarks compare).
  bool schedule_stream = true;
  // The cluster's token for this client's calls ("": none). Unset: the process's (SetCallToken,
  // else PATHWAYS_TOKEN), so one process may hold clients of clusters with different tokens.
  std::optional<std::string> token;
  // Test-only: runs go straight to their hosts instead of through their islands' schedulers, so
  // hosts may apply different clients' runs in different orders. Shows what the scheduler
  // prevents (gangs that share devices deadlocking in their collectives); never use otherwise.
  bool TEST_bypass_scheduler = false;
};

// What the client has sent, for tests and benchmarks that check per-run costs.
struct ClientStats {
  int64_t ops_sent = 0;  // every op: puts, program registrations, runs, frees
  int64_t op_bytes_sent = 0;
  int64_t run_ops_sent = 0;  // messages that start runs: one per run
  int64_t run_op_bytes_sent = 0;
  int64_t lowerings = 0;  // programs lowered (not found in the lowering cache)
  int64_t staged_put_bytes = 0;  // put bytes that went ahead over data streams, not with their ops
  int64_t frees_carried = 0;     // arrays freed by the run after their drop instead of by free ops
  // Runs whose message named each of their hosts with its place: a run group's first, and the
  // first after anything else took a place on one of its hosts. The others name only the group
  // and their number in it.
  int64_t runs_naming_hosts = 0;
  // Runs that named only their group and were sent again naming their hosts, because the
  // controller did not know the group's epoch (it restarted, or an earlier request was lost).
  int64_t runs_named_again = 0;
  // Schedule requests (batches of runs) over the schedule stream, and as unary gRPC calls (before
  // the stream is made, with TLS, or when the controller refused the stream).
  int64_t schedule_requests_streamed = 0;
  int64_t schedule_requests_unary = 0;
  // Op batches and fetches to this client's hosts over their data streams, and through gRPC
  // (none known yet or idle, or not served there), counted once the way is settled.
  int64_t worker_requests_streamed = 0;
  int64_t worker_requests_grpc = 0;
};

// A request for devices: a 1-, 2- or 3-D mesh, optionally pinned to one island.
struct SliceSpec {
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> axis_names;  // default "x", "y", "z"
  std::optional<int> island;
  // Without an island the slice is placed within one island (its collectives then stay on one
  // island's interconnect); true lets it span several, whose runs are ordered across islands by
  // the controller.
  bool span_islands = false;
  int64_t min_free_memory_bytes = 0;  // per device, as the controller last heard
  std::string device_kind;            // e.g. "cpu"; empty: any
};

struct PhysicalDeviceInfo {
  DeviceId device_id;
  HostId host_id;
  std::string host_address;
  int local_index;
  int island;
  std::vector<int32_t> coords;  // in the island's device mesh: (host's rank in the island, local index)
  std::string incarnation;      // of the worker process holding it when the slice was mapped
  int64_t memory_capacity = 0;  // bytes; 0: not known
};

// Where a slice's virtual devices are, at one time. Immutable; remapping a slice makes a new one.
struct SliceMapping {
  MappingId id;  // unique within the client: names this mapping in lowered programs
  std::vector<PhysicalDeviceInfo> devices;  // row-major over the mesh
  std::vector<std::string> hosts;           // distinct host addresses, in device order
};

// A client's virtual slice of devices, mapped by the controller to physical devices, and
// remappable (Client::RemapSlice) without changing its id, mesh or the programs that use it.
// Cheap to copy; thread-safe.
class VirtualSlice {
 public:
  SliceId id() const { return data_->id; }
  const Mesh& mesh() const { return data_->mesh; }
  int64_t num_devices() const { return data_->mesh.num_devices(); }
  // The current mapping. Device i holds shard i of every array laid on the slice under it.
  std::shared_ptr<const SliceMapping> mapping() const;
  // The current mapping's devices and distinct hosts. The references stay valid for the slice's
  // life, even after a remap (every mapping is kept).
  const std::vector<PhysicalDeviceInfo>& devices() const { return mapping()->devices; }
  const std::vector<std::string>& host_addresses() const { return mapping()->hosts; }
  std::string ToString() const;

 private:
  friend class Client;
  friend class ClientCore;
  struct Data {
    SliceId id;
    Mesh mesh;
    uint64_t owner;  // the serial of the ClientCore that made it
    mutable absl::Mutex mu;
    std::vector<std::shared_ptr<const SliceMapping>> mappings ABSL_GUARDED_BY(mu);  // newest last
  };
  std::shared_ptr<const Data> data_;
};

// A compiled function's static signature and body. Input and output specs are global shapes; the
// body runs on every device of a slice on local shards, laid out by the in/out shardings.
struct FunctionSpec {
  FunctionBody body;
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  std::vector<PartitionSpec> in_shardings;   // one per input; empty: all replicated
  std::vector<PartitionSpec> out_shardings;  // one per output; empty: all replicated
  // Declares that what the function's successors need depends on its computed values. Hosts
  // then set up the successors only after it has run (sequential dispatch), instead of at once.
  bool data_dependent_shapes = false;
  // Inputs whose buffers the function takes for its outputs (donation): input i's buffer becomes
  // the first output with the same spec and sharding that no earlier donated input took. The
  // body sees the two as one buffer, so it may update the input in place (an optimizer step then
  // holds one copy of the parameters, not two). A call invalidates the caller's handles to the
  // arrays it is given at donated positions: using them afterwards is an error. Where a host
  // cannot hand the buffer over (an earlier run still reads it), it copies it first, so the
  // result is the same either way. Bodies must not update inputs that are not donated.
  std::vector<int> donated_inputs;
  // Per output, the donated input whose buffer it takes, or -1. Assumes a validated spec.
  std::vector<int> OutputDonors() const;

  static FunctionSpec Builtin(std::string kernel, std::vector<TensorSpec> inputs,
                              std::vector<TensorSpec> outputs,
                              std::vector<PartitionSpec> in_shardings = {},
                              std::vector<PartitionSpec> out_shardings = {});
  static FunctionSpec Script(std::string name, std::string source, std::vector<TensorSpec> inputs,
                             std::vector<TensorSpec> outputs,
                             std::vector<PartitionSpec> in_shardings = {},
                             std::vector<PartitionSpec> out_shardings = {});
  // The vector-Jacobian product of `primal` (see FunctionBody::Gradient): it takes the primal's
  // inputs and then one cotangent per floating-point output (laid out as that output), and
  // returns the primal's outputs when `with_outputs` (a loss and its gradients in one call), then
  // the cotangents of inputs `wrt` (default: every floating-point input), each laid out as its
  // input. Cotangents are of the global function: what the body computes on shards, with its
  // collectives, is differentiated as the function of whole arrays that it is.
  static absl::StatusOr<FunctionSpec> Vjp(const FunctionSpec& primal, std::vector<int> wrt = {},
                                          bool with_outputs = false);
  // The same product in two calls that keep the forward pass's intermediates (residuals) on the
  // devices instead of recomputing them, as jax.vjp does. `forward` takes the primal's inputs and
  // returns its outputs, then a residual handle: an i64 scalar, replicated, holding the bytes its
  // residuals take on each device, which stay charged to those devices until the handle is freed.
  // `backward` takes the handle, then one cotangent per floating-point output, and returns the
  // cotangents of inputs `wrt`; it may be called again with other cotangents. Call both on the
  // same slice: a handle moved to other devices, or used on the same devices as another mesh, is
  // refused (FailedPrecondition). `forward` takes no donated inputs. One forward pass saved per
  // call, for the memory of every intermediate until then (in a pipeline, of every microbatch in
  // flight).
  struct SplitVjp;
  static absl::StatusOr<SplitVjp> VjpKeepingResiduals(const FunctionSpec& primal, std::vector<int> wrt = {});
};
struct FunctionSpec::SplitVjp {
  FunctionSpec forward;
  FunctionSpec backward;
};

// A function compiled on the cluster's workers. Cheap to copy; thread-safe.
class CompiledFunction {
 public:
  const std::string& name() const;
  const FunctionSpec& spec() const;

  struct State;  // opaque: defined inside the client library

 private:
  friend class Client;
  friend class ClientCore;
  std::shared_ptr<State> state_;
};

// One logical array whose shards live in the workers. The client holds one handle per logical
// array; when the last copy of a handle goes, the shards are freed on every host. Thread-safe.
class ShardedArray {
 public:
  ArrayId id() const;
  const TensorSpec& spec() const;
  const Sharding& sharding() const;
  const VirtualSlice& slice() const;
  std::string ToString() const;

  struct State;  // opaque: defined inside the client library

 private:
  friend class Client;
  friend class ClientCore;
  std::shared_ptr<const State> state_;
};

// A connection to one cluster. Thread-safe.
class Client {
 public:
  // Sends `options.token`, else the process's (SetCallToken, else PATHWAYS_TOKEN, if set): a token
  // that is not printable ASCII of at most 4096 bytes is InvalidArgument. Uses TLS with the
  // authority in PATHWAYS_TLS_CA (and a certificate from PATHWAYS_TLS_CERT/_KEY), if set, unless
  // the process set up TLS itself.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& controller_address,
                                                         const ClientOptions& options = {});
  ~Client();

  const std::string& id() const;
  // A readable table of islands, hosts and devices.
  absl::StatusOr<std::string> DescribeCluster();

  absl::StatusOr<VirtualSlice> CreateSlice(const SliceSpec& spec);
  // The client's slices that lost devices (a host stopped heartbeating or restarted), with why.
  // What their arrays held on those devices is gone.
  struct LostSlice {
    SliceId slice_id;
    std::string reason;
  };
  absl::StatusOr<std::vector<LostSlice>> LostSlices();
  // Maps `slice` onto live devices again, with the constraints it was created with. Programs
  // that use it are lowered again at their next run; arrays placed before keep their placement.
  absl::Status RemapSlice(const VirtualSlice& slice);
  // Compiles the body on every live worker (once per content hash on each), so a syntax or type
  // error comes back here, naming the function and line.
  absl::StatusOr<CompiledFunction> Compile(const FunctionSpec& spec);
  // Copies host data onto a slice, laid out by `partition`. The copy is taken before returning.
  absl::StatusOr<ShardedArray> Put(const HostArray& data, const VirtualSlice& slice,
                                   const PartitionSpec& partition = {});
  // The same, taking the data: shards that are the whole array (one device, or replicated) send
  // its bytes without a copy.
  absl::StatusOr<ShardedArray> Put(HostArray&& data, const VirtualSlice& slice, const PartitionSpec& partition = {});
  // Runs `function` on every device of `slice` and returns its outputs at once. Inputs that live
  // elsewhere or are laid out differently are moved host to host as the function needs them.
  absl::StatusOr<std::vector<ShardedArray>> Call(const CompiledFunction& function,
                                                 const VirtualSlice& slice,
                                                 absl::Span<const ShardedArray> inputs);
  // Runs a traced program with one client call. Returns the program's results at once, as
  // futures. Lowering (virtual to physical devices, transfers between differently laid out
  // values) is cached per program and argument placement; each run sends one small message per
  // host, whatever the number of shards.
  absl::StatusOr<std::vector<ShardedArray>> Run(const Program& program,
                                                absl::Span<const ShardedArray> args,
                                                const RunOptions& options = {});
  // The lowered form of `program` for these arguments: physical devices per slice, hosts per node.
  absl::StatusOr<std::string> DescribeLowering(const Program& program,
                                               absl::Span<const ShardedArray> args);
  ClientStats stats() const;

  // What the cluster's devices ran for this client since `since`, as Chrome trace-event JSON
  // (open it in Perfetto or chrome://tracing): one process per host, one thread per device, one
  // slice per shard of a computation. Other clients' work is not included.
  absl::StatusOr<std::string> TraceJson(absl::Time since = absl::InfinitePast());
  absl::Status WriteTrace(const std::string& path, absl::Time since = absl::InfinitePast());

  // The whole array, once computed; or the error that prevented it.
  Future<HostArray> Fetch(const ShardedArray& array);
  // Completes when every shard is computed (or with the error).
  Future<Unit> Ready(const ShardedArray& array);
  // Completes once the run that produces the array is enqueued on every host it runs on (its
  // island schedulers took it and passed it on), without waiting for the computation; or with
  // why it never will be. A host applies it once it has the client's earlier ops (a Put or Free
  // still on its way is waited for). Put arrays are enqueued when Put returns. A client that wants few
  // runs in flight, or the paper's OpByOp client, waits on this before its next call.
  Future<Unit> Enqueued(const ShardedArray& array);

 private:
  explicit Client(std::shared_ptr<ClientCore> core);
  // Whether the array was made by this client (and is not an empty handle).
  bool Owns(const ShardedArray& array) const;
  // InvalidArgument unless it was.
  absl::Status CheckOwned(const ShardedArray& array, const char* what) const;
  // Run, once the arguments are known to be right.
  // Put's body: `bytes` holds the array of `spec`; `whole`, when set, holds the same bytes, shared
  // by the shards that are the whole array.
  absl::StatusOr<ShardedArray> PutBytes(const TensorSpec& spec, const char* bytes,
                                        std::shared_ptr<std::string> whole, const VirtualSlice& slice,
                                        const PartitionSpec& partition);
  absl::StatusOr<std::vector<ShardedArray>> RunChecked(const Program& program, absl::Span<const ShardedArray> args,
                                                       const RunOptions& options);
  // Spends the handles of `arrays` at donated `positions`, once earlier fetches of them are done.
  // An array given at a donated position may appear only once. Returns the spent handles, to
  // restore if the run is not sent after all.
  absl::StatusOr<std::vector<std::shared_ptr<const ShardedArray::State>>> Donate(const std::string& what,
                                                                                 const std::vector<int>& positions,
                                                                                 absl::Span<const ShardedArray> arrays);
  // Arrays given to a function or program: right number, right specs, this client's.
  absl::Status CheckArrays(const std::string& what, const char* noun, const std::vector<TensorSpec>& specs,
                           absl::Span<const ShardedArray> arrays) const;
  std::shared_ptr<ClientCore> core_;
};

}  // namespace pathways
