#pragma once
// MOELINE_CHECK(condition, message): an invariant of the code, not a property of input. When it
// fails it is a bug: log file:line and the message, then abort. Input errors are values (Status,
// Expected) or exceptions at the boundary, never this.

#include <cstdio>
#include <cstdlib>

#define MOELINE_CHECK(condition, message)                                                       \
  do {                                                                                          \
    if (!(condition)) {                                                                         \
      std::fprintf(stderr, "moeline: invariant failed at %s:%d: %s (%s)\n", __FILE__, __LINE__, \
                   message, #condition);                                                        \
      std::abort();                                                                             \
    }                                                                                           \
  } while (false)
