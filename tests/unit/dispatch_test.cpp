// Handler tables (stages/runtime/dispatch.h): a message goes to the one handler listed for its
// type, any other type is reported as unexpected, and a bad table does not compile
// (tests/boundaries/check_handler_tables.py compiles the bad ones and expects the compiler to
// refuse them; MOELINE_BAD_TABLE selects one).

#include "stages/runtime/dispatch.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moeline::runtime {
namespace {

struct Recorder {
  std::vector<std::string> calls;
  void on_job(int& value) { calls.push_back("job " + std::to_string(value++)); }
  void on_cancel(int& value) { calls.push_back("cancel " + std::to_string(value)); }
};

constexpr HandlerTable<Recorder, 2, int&> kTable({
    {wire::MessageType::PrefillJob, &Recorder::on_job},
    {wire::MessageType::CancelJob, &Recorder::on_cancel},
});

static_assert(kTable.handles(wire::MessageType::PrefillJob));
static_assert(kTable.handles(wire::MessageType::CancelJob));
static_assert(!kTable.handles(wire::MessageType::Hello));
static_assert(is_message_type(wire::MessageType::ControlReply));
static_assert(!is_message_type(static_cast<wire::MessageType>(0)));

#if MOELINE_BAD_TABLE == 1
// A type listed twice.
constexpr HandlerTable<Recorder, 2, int&> kTwice({
    {wire::MessageType::PrefillJob, &Recorder::on_job},
    {wire::MessageType::PrefillJob, &Recorder::on_cancel},
});
#elif MOELINE_BAD_TABLE == 2
// A value the wire does not define.
constexpr HandlerTable<Recorder, 1, int&> kUnknown({
    {static_cast<wire::MessageType>(99), &Recorder::on_job},
});
#elif MOELINE_BAD_TABLE == 3
// More rows declared than listed: the missing one has no type and no handler.
constexpr HandlerTable<Recorder, 3, int&> kShort({
    {wire::MessageType::PrefillJob, &Recorder::on_job},
    {wire::MessageType::CancelJob, &Recorder::on_cancel},
});
#elif MOELINE_BAD_TABLE == 4
// A row without a handler.
constexpr HandlerTable<Recorder, 1, int&> kNoHandler({
    {wire::MessageType::PrefillJob, nullptr},
});
#endif

TEST(HandlerTable, SendsEachTypeToItsHandlerAndNothingElse) {
  Recorder recorder;
  int value = 7;
  EXPECT_TRUE(kTable.dispatch(recorder, wire::MessageType::PrefillJob, value));
  EXPECT_TRUE(kTable.dispatch(recorder, wire::MessageType::CancelJob, value));
  EXPECT_FALSE(kTable.dispatch(recorder, wire::MessageType::TokenBatch, value));
  EXPECT_FALSE(kTable.dispatch(recorder, static_cast<wire::MessageType>(99), value));
  EXPECT_EQ(recorder.calls, (std::vector<std::string>{"job 7", "cancel 8"}));
}

}  // namespace
}  // namespace moeline::runtime
