#pragma once
// Bulk frames handed over through shared memory between two processes of one node. A peer to peer
// transfer (intake.h) normally crosses a ZeroMQ socket: on loopback tcp:// that is two kernel
// copies, and with Curve an encryption and a decryption of every byte in the I/O threads. When
// the sender and the receiving intake share a node, the sender copies the message's bulk frames (a
// prompt's KV, a snapshot's blocks) into its arena, a shared-memory file it created once and keeps
// mapped, and sends the header and body with a reference (arena, slot, offset, sizes) in place of
// the bulk; the receiver maps the arena once, copies the frames out and marks the slot done, and
// the sender reuses the space. Nothing is created, unlinked, faulted in or unmapped per transfer
// (each of which costs more than the copy: docs/PERFORMANCE.md). The body (its ticket, the bulk
// frames' sizes and xxHashes) still travels over the socket, under Curve where Curve is on.
//
// Who shares a node: an intake announces a node token (in its hello, and so in the routes the
// gateway hands out): a hash of the kernel's boot id, the folder's device and inode, the pid
// namespace and the user id. A sender uses shared memory only for a route whose token equals its
// own, so processes of different containers (another /dev/shm), users or hosts never try;
// everything else crosses the socket as before.
//
// Trust: the folder is the user's own (0700, created if missing, refused if another user owns it
// or others may write it) and each arena 0600, so only a process of the same user, which could
// read this process's memory anyway, can read or write a transfer. The receiver opens an arena
// only by a name of the form senders write, without following links, a regular file of its own
// user with an arena's header; it reads a slot only while the slot's word says it holds that
// transfer (a generation number guards against a slot reclaimed and reused meanwhile), and the
// frames are then checked against the body's descriptors as any bulk frame is (wire::check_bulk).
//
// Lifetime: a slot is the sender's again once the receiver marked it done, or after stale_after
// (a receiver that died with the message queued; a reader that late finds the generation changed
// and refuses). An arena is unlinked when its sender closes; one whose sender died is unlinked by
// the next sweep of any intake on the node (its creator's pid is in its name, and the node token
// includes the pid namespace). A transfer that does not fit the arena crosses the socket.
//
// Not thread-safe.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "base/status.h"

namespace moeline::runtime {

class Registry;
class Counter;

// The envelope header's flag (wire.h: u16 at byte 10) that says the bulk frames were replaced by
// one reference frame to a shared-memory arena.
inline constexpr uint16_t kSharedBulkFlag = 1;

struct SharedBulkSettings {
  bool enabled = true;
  // Empty: /dev/shm/moeline-<uid>.
  std::string folder;
  // Transfers with fewer bulk bytes cross the socket (measured in docs/PERFORMANCE.md).
  size_t min_bytes = 4096;
  // A sender's arena: address space reserved at its first transfer; pages stay allocated once
  // touched (what the largest transfers in flight at once needed).
  size_t arena_bytes = size_t{256} << 20;
  std::chrono::seconds stale_after{300};
};

// `--shm-handover` ("auto": the default folder; "off"; or a folder), `--shm-handover-min-bytes`
// and `--shm-handover-arena-bytes`.
SharedBulkSettings shared_bulk_settings(const std::string& mode, int64_t min_bytes,
                                        int64_t arena_bytes);

class SharedBulk {
 public:
  // Opens (creates) the folder. An error when it cannot be used (then transfers use the socket).
  static Expected<std::unique_ptr<SharedBulk>> open(const SharedBulkSettings& settings,
                                                    Registry& metrics);
  ~SharedBulk();
  SharedBulk(const SharedBulk&) = delete;
  SharedBulk& operator=(const SharedBulk&) = delete;

  // This node's token (what an intake announces, and a route to it carries).
  const std::string& node() const { return node_; }
  const std::string& folder() const { return folder_; }

  // Sender: whether frames ([header][body][bulk]...) for a route with token `route_node` go
  // through shared memory; when they do, the bulk frames are copied into the arena and replaced
  // by their reference, the header's flag set, and the slot is returned. Nothing (frames
  // untouched) when the route is elsewhere, the bulk is small, or the arena has no room or
  // cannot be made (counted; the socket carries them).
  std::optional<uint32_t> export_frames(const std::string& route_node,
                                        std::vector<zmq::message_t>& frames);
  // When a message whose bulk went to `slot` was not sent after all: the slot is free again.
  void discard(uint32_t slot);

  // Receiver: a message whose header has the flag gets its bulk frames back from the arena
  // (copied into new frames); messages without it are left alone. An error for a reference that
  // does not hold (the caller refuses the message).
  Status import_frames(std::vector<zmq::message_t>& frames, size_t max_bulk_bytes);

  // Unlinks the arenas of senders that are gone and lets go of those this receiver had mapped
  // (at most once a minute; `force`: now).
  void sweep(bool force = false);

  // The arena's free space as the sender sees it (tests).
  size_t arena_in_use() const;

 private:
  struct Arena;
  struct Mapped;
  SharedBulk(SharedBulkSettings settings, int folder_fd, std::string folder, std::string node,
             Registry& metrics);
  Arena* own_arena();
  Expected<Mapped*> mapped(const std::string& name);
  void reclaim();

  SharedBulkSettings settings_;
  int folder_fd_ = -1;
  std::string folder_, node_;
  std::unique_ptr<Arena> arena_;
  bool arena_failed_ = false;
  std::list<std::unique_ptr<Mapped>> mapped_;  // most recently used first
  Counter *sent_, *sent_bytes_, *received_, *received_bytes_, *no_room_, *swept_;
  std::chrono::steady_clock::time_point last_sweep_{};
};

// Whether a message's header ([0], 16 bytes) has the shared-bulk flag.
bool has_shared_bulk_flag(const std::vector<zmq::message_t>& frames);

}  // namespace moeline::runtime
