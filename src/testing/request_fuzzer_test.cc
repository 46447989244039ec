// Hostile and random requests against the decoding and validation paths: every one comes back
// as a Status, nothing crashes, and the host keeps serving. Bounded: a fixed number of inputs
// from a fixed seed. The open-ended version is the libFuzzer target (make fuzz).
#include "testing/request_fuzzer.h"

#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace pathways {
namespace {

std::string Bytes(uint8_t kind, const google::protobuf::Message& m) {
  return std::string(1, static_cast<char>(kind)) + m.SerializeAsString();
}

rpc::ProgramProto ValidProgram() {
  rpc::ProgramProto p;
  p.set_program_id(7);
  p.set_name("valid");
  rpc::SliceProto* slice = p.add_slices();
  slice->set_slice_id(1);
  slice->add_mesh_dims(2);
  slice->add_axis_names("x");
  for (int d = 0; d < 2; ++d) {
    rpc::SliceDevice* device = slice->add_devices();
    device->set_device_id(d);
    device->set_host_address(RequestFuzzer::kHost);
    device->set_local_index(d);
  }
  rpc::ProgramArg* arg = p.add_args();
  arg->mutable_spec()->set_dtype(1);
  arg->mutable_spec()->add_shape(8);
  arg->set_slice_id(1);
  arg->mutable_sharding()->add_dims("x");
  rpc::ProgramNode* node = p.add_nodes();
  node->set_function_key("no-such-function");
  node->set_function_name("f");
  node->set_slice_id(1);
  rpc::ValueRef* in = node->add_inputs();
  in->set_is_arg(true);
  *node->add_input_specs() = arg->spec();
  *node->add_in_shardings() = arg->sharding();
  *node->add_output_specs() = arg->spec();
  *node->add_out_shardings() = arg->sharding();
  p.add_results()->set_index(0);
  return p;
}

rpc::EnqueueRequest ValidEnqueue() {
  rpc::EnqueueRequest r;
  r.set_client_id("fuzz");
  rpc::Op* put = r.add_ops();
  put->set_seq(1);
  put->mutable_put()->mutable_dest()->set_array_id(1);
  put->mutable_put()->mutable_spec()->set_dtype(1);
  put->mutable_put()->mutable_spec()->add_shape(4);
  put->mutable_put()->set_data(std::string(16, '\0'));
  rpc::Op* reg = r.add_ops();
  reg->set_seq(2);
  *reg->mutable_register_program()->mutable_program() = ValidProgram();
  rpc::Op* run = r.add_ops();
  run->set_seq(3);
  run->mutable_run()->set_program_id(7);
  run->mutable_run()->add_arg_array_ids(1);
  run->mutable_run()->set_output_array_base(100);
  run->mutable_run()->set_epoch(1);
  return r;
}

// Sets one field somewhere in `m` to a value a careless or hostile sender might put there:
// extremes for numbers, odd strings, elements added to or dropped from repeated fields.
void MutateField(google::protobuf::Message& m, std::mt19937& rng, int depth = 0) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const google::protobuf::Reflection* r = m.GetReflection();
  if (d->field_count() == 0) return;
  const FieldDescriptor* f = d->field(static_cast<int>(rng() % d->field_count()));
  static const int64_t kExtremes[] = {0, -1, 1, 2, 7, 1 << 20, int64_t{1} << 31, int64_t{1} << 60,
                                      std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  const int64_t n = kExtremes[rng() % (sizeof(kExtremes) / sizeof(kExtremes[0]))];
  static const char* kStrings[] = {"", "x", "127.0.0.1:1", "no-such", "x,x", "\xff\xfe", "y,z,w"};
  const std::string str = kStrings[rng() % (sizeof(kStrings) / sizeof(kStrings[0]))];
  if (f->is_repeated()) {
    const int size = r->FieldSize(m, f);
    if (size > 0 && rng() % 3 == 0) {
      r->RemoveLast(&m, f);
      return;
    }
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT64: r->AddInt64(&m, f, n); return;
      case FieldDescriptor::CPPTYPE_INT32: r->AddInt32(&m, f, static_cast<int32_t>(n)); return;
      case FieldDescriptor::CPPTYPE_STRING: r->AddString(&m, f, str); return;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        if (size > 0 && depth < 4) {
          MutateField(*r->MutableRepeatedMessage(&m, f, static_cast<int>(rng() % size)), rng, depth + 1);
        } else {
          r->AddMessage(&m, f);
        }
        return;
      default: return;
    }
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(&m, f, n); return;
    case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(&m, f, static_cast<int32_t>(n)); return;
    case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(&m, f, !r->GetBool(m, f)); return;
    case FieldDescriptor::CPPTYPE_DOUBLE: r->SetDouble(&m, f, static_cast<double>(n)); return;
    case FieldDescriptor::CPPTYPE_STRING: r->SetString(&m, f, str); return;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      if (depth < 4) MutateField(*r->MutableMessage(&m, f), rng, depth + 1);
      return;
    default: return;
  }
}

// A Put then a Fetch of it by a fresh client: the host still serves.
void ExpectStillServing(RequestFuzzer& fuzzer, const std::string& client) {
  rpc::EnqueueRequest put;
  put.set_client_id(client);
  rpc::Op* op = put.add_ops();
  op->set_seq(1);
  op->mutable_put()->mutable_dest()->set_array_id(5);
  op->mutable_put()->mutable_spec()->set_dtype(1);
  op->mutable_put()->mutable_spec()->add_shape(2);
  const float values[2] = {1.5f, -2.0f};
  op->mutable_put()->set_data(std::string(reinterpret_cast<const char*>(values), sizeof(values)));
  ASSERT_TRUE(fuzzer.runtime().Enqueue(put).ok());
  rpc::FetchRequest fetch;
  fetch.set_client_id(client);
  fetch.set_array_id(5);
  fetch.add_shards(0);
  auto got = std::make_shared<rpc::FetchResponse>();  // written until the fetch completes
  Future<Unit> fetched = fuzzer.runtime().Fetch(fetch, got.get());
  fetched.OnReady([got](const absl::StatusOr<Unit>&) {});
  auto done = fetched.AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(got->shards_size(), 1);
  EXPECT_EQ(got->shards(0).data(), op->put().data());
}

TEST(RequestFuzzerTest, HostileRequestsGetClearErrors) {
  RequestFuzzer fuzzer;
  // An array of 2^60 elements.
  rpc::EnqueueRequest huge;
  huge.set_client_id("c");
  rpc::Op* op = huge.add_ops();
  op->set_seq(1);
  op->mutable_put()->mutable_spec()->set_dtype(1);
  op->mutable_put()->mutable_spec()->add_shape(int64_t{1} << 30);
  op->mutable_put()->mutable_spec()->add_shape(int64_t{1} << 30);
  absl::Status s = fuzzer.runtime().Enqueue(huge);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A device that does not exist, an op of no kind, no client id, an old sequence number.
  op->mutable_put()->mutable_spec()->clear_shape();
  op->mutable_put()->set_local_device(-3);
  op->set_seq(2);
  EXPECT_EQ(fuzzer.runtime().Enqueue(huge).code(), absl::StatusCode::kInvalidArgument);
  huge.clear_client_id();
  EXPECT_EQ(fuzzer.runtime().Enqueue(huge).code(), absl::StatusCode::kInvalidArgument);
  rpc::EnqueueRequest stale;
  stale.set_client_id("c");
  stale.add_ops()->set_seq(1);
  EXPECT_EQ(fuzzer.runtime().Enqueue(stale).code(), absl::StatusCode::kInvalidArgument);
  // A mesh of a million devices.
  rpc::AllocateSliceRequest million;
  million.add_mesh_shape(1000);
  million.add_mesh_shape(1000);
  auto slice = fuzzer.registry().AllocateSlice(million, absl::UnixEpoch());
  EXPECT_EQ(slice.status().code(), absl::StatusCode::kResourceExhausted) << slice.status();
  // A handle that does not exist, and one that belongs to another client.
  ExpectStillServing(fuzzer, "owner");
  rpc::FetchRequest fetch;
  rpc::FetchResponse response;
  fetch.set_client_id("owner");
  fetch.set_array_id(404);
  fetch.add_shards(0);
  EXPECT_EQ(fuzzer.runtime().Fetch(fetch, &response).Await().status().code(), absl::StatusCode::kNotFound);
  fetch.set_client_id("thief");
  fetch.set_array_id(5);
  EXPECT_EQ(fuzzer.runtime().Fetch(fetch, &response).Await().status().code(), absl::StatusCode::kNotFound);
  // A program whose values refer forward, to a slice that does not exist.
  rpc::ProgramProto bad = ValidProgram();
  bad.mutable_nodes(0)->mutable_inputs(0)->set_is_arg(false);
  bad.mutable_nodes(0)->set_slice_id(99);
  EXPECT_FALSE(LoweredProgram::Create(bad, RequestFuzzer::kHost, 2).ok());
}

TEST(RequestFuzzerTest, RandomAndMutatedRequestsNeverCrashTheHost) {
  RequestFuzzer fuzzer;
  std::mt19937 rng(20261130);
  std::vector<std::unique_ptr<google::protobuf::Message>> messages;  // by request kind
  messages.push_back(std::make_unique<rpc::EnqueueRequest>(ValidEnqueue()));
  messages.push_back(std::make_unique<rpc::FetchRequest>());
  messages.push_back(std::make_unique<rpc::AllocateSliceRequest>());
  messages.push_back(std::make_unique<rpc::RegisterWorkerRequest>());
  messages.push_back(std::make_unique<rpc::ScheduledBatch>());
  messages.push_back(std::make_unique<rpc::ProgramProto>(ValidProgram()));
  messages.push_back(std::make_unique<rpc::HeartbeatRequest>());
  messages.push_back(std::make_unique<rpc::ControlGraph>());
  const std::vector<std::string> valid = {
      Bytes(0, ValidEnqueue()), Bytes(5, ValidProgram()),
      [] {
        rpc::AllocateSliceRequest r;
        r.add_mesh_shape(2);
        return Bytes(2, r);
      }(),
      [] {
        rpc::RegisterWorkerRequest r;
        r.set_address("127.0.0.1:9");
        r.add_devices()->set_memory_capacity(1024);
        return Bytes(3, r);
      }(),
      [] {
        rpc::ScheduledBatch b;
        rpc::ScheduledOp* op = b.add_ops();
        op->set_client_id("fuzz");
        op->mutable_op()->set_seq(4);
        op->mutable_op()->mutable_run()->set_program_id(7);
        op->mutable_op()->mutable_run()->set_epoch(2);
        return Bytes(4, b);
      }(),
      [] {
        rpc::ControlGraph g;
        g.set_island(0);
        g.set_generation(3);
        g.set_controller_incarnation("fuzz");
        g.add_hosts(RequestFuzzer::kHost);
        g.add_hosts("127.0.0.1:9");
        return Bytes(7, g);
      }(),
  };
  for (int i = 0; i < 3000; ++i) {
    std::string input;
    if (const uint32_t how = rng() % 3; how == 0) {
      // A valid message of some kind with a few of its fields set to hostile values.
      const size_t kind = rng() % messages.size();
      std::unique_ptr<google::protobuf::Message> m(messages[kind]->New());
      m->CopyFrom(*messages[kind]);
      for (int e = 1 + static_cast<int>(rng() % 3); e > 0; --e) MutateField(*m, rng);
      input = Bytes(static_cast<uint8_t>(kind), *m);
    } else if (how == 1) {
      input.resize(rng() % 200);
      for (char& c : input) c = static_cast<char>(rng());
    } else {
      input = valid[rng() % valid.size()];
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && input.size() > 1; ++e) {
        const size_t at = 1 + rng() % (input.size() - 1);
        switch (rng() % 3) {
          case 0: input[at] = static_cast<char>(rng()); break;                      // flip a byte
          case 1: input.resize(at); break;                                           // truncate
          case 2: input.insert(at, 1 + rng() % 8, static_cast<char>(rng())); break;  // insert junk
        }
      }
    }
    fuzzer.Feed(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  }
  // Most inputs must get past decoding, or the test only exercises the protobuf parser.
  EXPECT_GT(fuzzer.decoded(), 1000) << fuzzer.decoded() << " of 3000 decoded";
  ExpectStillServing(fuzzer, "after-fuzzing");
}

}  // namespace
}  // namespace pathways
