// libFuzzer entry point: every input is one request for RequestFuzzer (src/testing).
#include <cstddef>
#include <cstdint>

#include "testing/request_fuzzer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* fuzzer = new pathways::RequestFuzzer();  // one host for the whole run
  fuzzer->Feed(data, size);
  return 0;
}
