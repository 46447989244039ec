#include "transport/rpc_util.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"

namespace pathways {
namespace {

// gRPC's own log lines (those its verbosity lets through: errors unless GRPC_VERBOSITY says
// otherwise) go through the project's log, with its levels, timestamps and --log-level, rather
// than gRPC's own format. Set when this file's code is linked in: every binary that makes a
// channel or a server does.
void ForwardGrpcLog(gpr_log_func_args* args) {
  const LogLevel level = args->severity == GPR_LOG_SEVERITY_ERROR  ? LogLevel::kError
                         : args->severity == GPR_LOG_SEVERITY_INFO ? LogLevel::kInfo
                                                                   : LogLevel::kDebug;
  if (level < MinLogLevel()) return;
  EmitLogLine(level, args->file, args->line, absl::StrCat("grpc: ", args->message));
}
[[maybe_unused]] const bool kGrpcLogForwarded = [] {
  gpr_set_log_function(ForwardGrpcLog);
  return true;
}();

}  // namespace

Executor& RpcCompletions() {
  static GrowingThreadPool* pool = new GrowingThreadPool("rpc-done", 64);
  return *pool;
}

int KeepaliveMs() {
  static const int ms = [] {
    constexpr int kDefault = 2000;
    const char* text = std::getenv("PATHWAYS_KEEPALIVE_MS");
    if (text == nullptr || *text == '\0') return kDefault;
    int value = 0;
    if (!absl::SimpleAtoi(text, &value) || value < 500 || value > 600'000) {
      PW_LOG(Warning) << "PATHWAYS_KEEPALIVE_MS='" << text << "' is not 500 to 600000; keepalive stays " << kDefault
                      << " ms";
      return kDefault;
    }
    return value;
  }();
  return ms;
}

void ConfigureServer(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients ping every KeepaliveMs() while they wait for an answer: allowed, however long.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, KeepaliveMs() / 2);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Connections are a bounded resource: one that never completes its handshake goes after 10 s,
  // one idle for 10 minutes is closed (its client reconnects when it next calls).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 600'000);
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, KeepaliveMs());
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, KeepaliveMs());
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A peer that restarts (a worker at the same address, a controller) is back within a second:
  // gRPC's default backoff grows to two minutes, during which calls to it fail at once. The
  // minimum is left alone: gRPC also uses it as the time a connection attempt may take, and at
  // 100 ms attempts on a loaded machine timed out before the handshake ("before receiving
  // SETTINGS frame"), so a worker could fail to re-register for good.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(grpc::ServerBuilder& builder, const std::string& what,
                                                         const std::string& address, const int* port) {
  // Controllers and workers give others the address they listen on (registrations, control
  // graphs): a wildcard would send every peer to itself.
  const std::string host = address.substr(0, address.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host == "::" || host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " cannot listen on ", address,
                                                   ": it tells other hosts to reach it at the address it listens "
                                                   "on, and a wildcard reaches no one; listen on the address they "
                                                   "reach this machine by"));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat(what, " cannot listen on ", address,
                                               ": the port is taken by another process, or the address is not "
                                               "one of this machine's"));
  }
  return server;
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status FromGrpc(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  // gRPC's words for a peer that stopped answering its keepalive pings.
  const bool silent = status.error_message().find("keepalive watchdog timeout") != std::string::npos;
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message(),
                                   silent ? " (the process stopped answering: frozen, cut off or overloaded)" : ""));
}

rpc::TensorSpecProto ToProto(const TensorSpec& spec) {
  rpc::TensorSpecProto p;
  p.set_dtype(static_cast<int32_t>(spec.dtype));
  for (int64_t d : spec.shape) p.add_shape(d);
  return p;
}

absl::StatusOr<TensorSpec> FromProto(const rpc::TensorSpecProto& proto) {
  if (!IsValidDType(proto.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("invalid dtype code ", proto.dtype()));
  }
  TensorSpec spec{static_cast<DType>(proto.dtype()), Shape(proto.shape().begin(), proto.shape().end())};
  auto size = ByteSize(spec.dtype, spec.shape);
  if (!size.ok()) return size.status();
  return spec;
}

rpc::RegionProto ToProto(const Region& region) {
  rpc::RegionProto p;
  for (int64_t s : region.start) p.add_start(s);
  for (int64_t s : region.size) p.add_size(s);
  return p;
}

Region FromProto(const rpc::RegionProto& proto) {
  return Region{Shape(proto.start().begin(), proto.start().end()),
                Shape(proto.size().begin(), proto.size().end())};
}

rpc::FunctionBodyProto ToProto(const FunctionBody& body) {
  rpc::FunctionBodyProto proto;
  proto.set_kind(static_cast<int>(body.kind));
  proto.set_name(body.name);
  proto.set_source(body.source);
  proto.set_source_file(body.source_file);
  if (body.gradient) {
    rpc::GradientProto* g = proto.mutable_gradient();
    for (int i : body.gradient->wrt) g->add_wrt(i);
    for (const auto& spec : body.gradient->in_specs) *g->add_in_specs()->mutable_dims() = {spec.begin(), spec.end()};
    for (const auto& spec : body.gradient->out_specs) *g->add_out_specs()->mutable_dims() = {spec.begin(), spec.end()};
    g->set_with_outputs(body.gradient->with_outputs);
    g->set_residuals(static_cast<int32_t>(body.gradient->residuals));
  }
  return proto;
}

absl::StatusOr<FunctionBody> FromProto(const rpc::FunctionBodyProto& proto) {
  FunctionBody body;
  body.kind = static_cast<FunctionBody::Kind>(proto.kind());
  body.name = proto.name();
  body.source = proto.source();
  body.source_file = proto.source_file();
  if (proto.has_gradient()) {
    FunctionBody::Gradient g;
    g.wrt.assign(proto.gradient().wrt().begin(), proto.gradient().wrt().end());
    for (const auto& spec : proto.gradient().in_specs()) g.in_specs.emplace_back(spec.dims().begin(), spec.dims().end());
    for (const auto& spec : proto.gradient().out_specs()) g.out_specs.emplace_back(spec.dims().begin(), spec.dims().end());
    g.with_outputs = proto.gradient().with_outputs();
    g.residuals = static_cast<FunctionBody::Residuals>(proto.gradient().residuals());
    body.gradient = std::move(g);
  }
  if (absl::Status s = ValidateFunctionBody(body); !s.ok()) return s;
  return body;
}

}  // namespace pathways
