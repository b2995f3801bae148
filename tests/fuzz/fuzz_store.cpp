// The rendezvous store's wire protocol as the server reads it: the input is what one client sent over
// its connection (frames [u32 length][u8 op][payload]), served by a fresh server whose waits and
// watches time out at once. When the first byte is odd, a valid hello frame goes first, so that the
// fuzzer spends its time past the handshake; the rest of the input follows it.
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_util.h"
#include "parallel/store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string bytes;
  if (data[0] & 1) {
    const uint32_t len = 9;
    const uint8_t hello = 1;
    const int64_t magic = 0x316e7274676e6f6c;  // "longtrn1", store.cpp's kMagic
    bytes.append(reinterpret_cast<const char*>(&len), 4);
    bytes.push_back(static_cast<char>(hello));
    bytes.append(reinterpret_cast<const char*>(&magic), 8);
  }
  bytes.append(reinterpret_cast<const char*>(data + 1), size - 1);
  longtrain::fuzz::expect_clean([&] { (void)longtrain::parallel::serve_bytes_for_fuzzing(bytes); });
  return 0;
}
