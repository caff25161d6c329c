#pragma once
// Bulk frames handed over through shared memory between two processes of one node. A peer to peer
// transfer (intake.h) normally crosses a ZeroMQ socket: on loopback tcp:// that is two kernel
// copies, and with Curve an encryption and a decryption of every byte in the I/O threads. When
// the sender and the receiving intake share a node, the sender writes the message's bulk frames
// (a prompt's KV, a snapshot's blocks) once into a file of a shared-memory folder and sends the
// header and body with a reference to it in place of the bulk; the receiver maps the file,
// unlinks it and hands the frames on without copying them. The body (its ticket, the bulk
// frames' sizes and xxHashes) still travels over the socket, under Curve where Curve is on.
//
// Who shares a node: an intake announces a node token (in its hello, and so in the routes the
// gateway hands out): a hash of the kernel's boot id, the folder's device and inode and the user
// id. A sender uses shared memory only for a route whose token equals its own, so two processes
// of different containers (another /dev/shm), users or hosts never try; everything else crosses
// the socket as before.
//
// Trust: the folder is the user's own (0700, created if missing, refused if another user owns
// it or others may write it) and each file 0600, so only a process of the same user, which could
// read this process's memory anyway, can write or read a transfer. The receiver takes a file
// only by a name of the form it writes, without following links, of a regular file of its own
// user whose size matches the reference; the frames are then checked against the body's
// descriptors as any bulk frame is (wire::check_bulk).
//
// Lifetime: the receiver unlinks a file as soon as it has mapped it (the mapping lives as long as
// the frames do); a file whose message was never received (the receiver died with it queued) is
// removed by the next sweep of any intake on the node (files older than `stale_after`).
//
// Not thread-safe; frames it hands out may be released on any thread.

#include <chrono>
#include <cstddef>
#include <cstdint>
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
// one reference frame to a shared-memory file.
inline constexpr uint16_t kSharedBulkFlag = 1;

struct SharedBulkSettings {
  bool enabled = true;
  // Empty: /dev/shm/moeline-<uid>.
  std::string folder;
  // Transfers with fewer bulk bytes cross the socket (a file's creation, mapping and unlinking
  // cost more than copying a few pages; measured in docs/PERFORMANCE.md).
  size_t min_bytes = size_t{64} << 10;
  std::chrono::seconds stale_after{300};
};

// `--shm-handover` ("auto": the default folder; "off"; or a folder) and
// `--shm-handover-min-bytes`.
SharedBulkSettings shared_bulk_settings(const std::string& mode, int64_t min_bytes);

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
  // through shared memory; when they do, the bulk frames are written to a file and replaced by
  // its reference, the header's flag set, and the file's name is returned. Nothing (frames
  // untouched) when the route is elsewhere, the bulk is small, or the write failed (counted; the
  // socket carries them).
  std::optional<std::string> export_frames(const std::string& route_node,
                                           std::vector<zmq::message_t>& frames);
  // When a message whose bulk went to the file `name` was not sent after all: remove the file.
  void discard(const std::string& name);

  // Receiver: a message whose header has the flag gets its bulk frames back from the file
  // (mapped, not copied); messages without it are left alone. An error for a reference that does
  // not hold (the caller refuses the message).
  Status import_frames(std::vector<zmq::message_t>& frames, size_t max_bulk_bytes);

  // Removes files older than the settings' stale_after (at most once a minute; `force`: now).
  void sweep(bool force = false);

 private:
  SharedBulk(SharedBulkSettings settings, int folder_fd, std::string folder, std::string node,
             Registry& metrics);

  SharedBulkSettings settings_;
  int folder_fd_ = -1;
  std::string folder_, node_;
  Counter *sent_, *sent_bytes_, *received_, *received_bytes_, *write_failures_, *swept_;
  std::chrono::steady_clock::time_point last_sweep_{};
};

// Whether a message's header ([0], 16 bytes) has the shared-bulk flag.
bool has_shared_bulk_flag(const std::vector<zmq::message_t>& frames);

}  // namespace moeline::runtime
