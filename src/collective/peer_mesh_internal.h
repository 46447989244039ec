// Internals shared by PeerMesh's files (peer_mesh.cc: the exchange of messages;
// peer_mesh_calls.cc: which call the mesh is in, and failures told to and read from the peers).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pathways::collective {

constexpr uint32_t kMessageMagic = 0x50574331;  // "PWC1"
// A failure notice (PeerMesh::Fail): the header's signature holds the status code, its payload
// the host where the failure began, the host that withdrew from the call (or nothing), and the
// cause, the first two each ended by a NUL.
constexpr uint32_t kNoticeMagic = 0x50574346;  // "PWCF"
constexpr size_t kMaxNoticeBytes = 4096;
// The largest message of a later call a host reads early and keeps for it (see Exchange).
constexpr uint64_t kMaxStashedBytes = uint64_t{1} << 30;

}  // namespace pathways::collective
