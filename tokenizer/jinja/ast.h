#pragma once
// The parsed template: statements (text, output, control flow) over expressions. Built once by
// the parser, then read-only; a Template can render from many threads at once.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace moeline::tokenizer::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args
    kTuple,     // args
    kDict,      // args as key, value, key, value...
    kGetAttr,   // args[0].name
    kGetItem,   // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]] (null where omitted)
    kCall,      // args[0](args[1..], kwargs)
    kFilter,    // args[0] | name(args[1..], kwargs)
    kTest,      // args[0] is [not] name(args[1..], kwargs)
    kNot,       // not args[0]
    kNegate,    // -args[0]
    kPlus,      // +args[0]
    kBinary,    // args[0] name args[1]: + - * / // % ** ~
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ...
    kAnd,       // args[0] and args[1]
    kOr,        // args[0] or args[1]
    kCondition  // args[0] if args[1] else args[2] (args[2] null when omitted)
  };
  Kind kind;
  int line;
  Value literal;
  std::string name;
  bool negated = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// Where `for` and `set` store: a name, a tuple of names (unpacking), or a namespace attribute.
struct Target {
  std::vector<std::string> names;
  std::string attribute;  // set only for `ns.attr`; names[0] is then the namespace
  bool unpack = false;
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required (undefined when omitted, as in jinja2)
};

struct Stmt {
  enum class Kind {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetBlock,
    kMacro,
    kCallBlock,
    kBreak,
    kContinue,
    kScope  // a body rendered in place (`generation` blocks, HF's AssistantTracker tag)
  };
  Kind kind;
  int line;
  std::string text;                                // kText; kMacro's name
  ExprPtr expr;                                    // output, for's iterable, set's value, call
  std::vector<std::pair<ExprPtr, Body>> branches;  // if / elif conditions and bodies
  Body body;
  Body else_body;  // if's else, for's else
  Target target;
  ExprPtr filter;  // for's `if` condition
  std::vector<MacroParam> params;
  bool catch_varargs = false;    // a macro whose body names `varargs` accepts extra positionals
  bool catch_kwargs = false;     // ... and `kwargs`, extra keywords
  std::vector<ExprPtr> filters;  // set block filters: kFilter nodes with a null subject
};

}  // namespace moeline::tokenizer::jinja
