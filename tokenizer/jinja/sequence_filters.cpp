// jinja2's filters over sequences and mappings.
#include <algorithm>
#include <map>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

List walk(Evaluator& ev, const Value& v) {
  List items = iterate(v);
  ev.count_steps(static_cast<int64_t>(items.size()));
  return items;
}

// jinja2's make_attrgetter: "a.b.0" walks items (numbers as indices); no attribute = the item.
Value lookup(const Value& item, const std::optional<std::string>& attribute) {
  if (!attribute) return item;
  Value v = item;
  size_t start = 0;
  while (true) {
    size_t dot = attribute->find('.', start);
    std::string part = attribute->substr(start, dot == std::string::npos ? dot : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    v = get_item(v, numeric ? Value::integer(std::stoll(part)) : Value::string(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value folded(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value::string(text::lower(v.as_string())) : v;
}

Value f_first(Evaluator&, const Value& v, CallArgs& args) {
  Params p("first", args, {});
  List items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(Evaluator&, const Value& v, CallArgs& args) {
  Params p("last", args, {});
  if (v.is_iterator()) fail("'generator' object is not reversible");
  List items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value f_join(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("join", args, {"d", "attribute"});
  std::string sep = p.has(0) ? p.get(0)->str() : "";
  std::optional<std::string> attribute = p.string(1);
  std::string out;
  bool first = true;
  for (const Value& item : walk(ev, v)) {
    if (!first) out += sep;
    first = false;
    out += lookup(item, attribute).str();
    ev.check_size(out.size());
  }
  return Value::string(std::move(out));
}

Value f_items(Evaluator&, const Value& v, CallArgs& args) {
  Params p("items", args, {});
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) fail("Can only get item pairs from a mapping.");
  List out;
  for (const auto& [k, value] : v.mapping().entries) out.push_back(Value::tuple({k, value}));
  return Value::iterator(std::move(out));
}

Value f_list(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("list", args, {});
  return Value::list(walk(ev, v));
}

template <class Less>
void sort_items(List& items, Less less) {
  std::stable_sort(items.begin(), items.end(), less);
}

Value f_dictsort(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("dictsort", args, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) fail("dictsort: can only sort a mapping");
  bool case_sensitive = p.flag(0, false);
  std::string by = p.string(1).value_or("key");
  if (by != "key" && by != "value") fail("You can only sort by either 'key' or 'value'");
  size_t pos = by == "key" ? 0 : 1;
  List items;
  for (const auto& [k, value] : v.mapping().entries) items.push_back(Value::tuple({k, value}));
  ev.count_steps(static_cast<int64_t>(items.size()));
  bool reverse = p.flag(2, false);
  sort_items(items, [&](const Value& a, const Value& b) {
    int c = compare(folded(a.items()[pos], case_sensitive), folded(b.items()[pos], case_sensitive));
    return reverse ? c > 0 : c < 0;
  });
  return Value::list(std::move(items));
}

// select / reject / selectattr / rejectattr: args are [attribute,] [test name, test args...].
Value select_or_reject(Evaluator& ev, const Value& v, CallArgs& args, bool select,
                       bool by_attribute) {
  const char* name =
      by_attribute ? (select ? "selectattr" : "rejectattr") : (select ? "select" : "reject");
  List rest = args.positional;
  std::optional<std::string> attribute;
  if (by_attribute) {
    if (rest.empty() || !rest[0].is_string())
      fail(std::string(name) + "() needs an attribute name");
    attribute = rest[0].as_string();
    rest.erase(rest.begin());
  }
  std::optional<std::string> test;
  if (!rest.empty()) {
    if (!rest[0].is_string()) fail(std::string(name) + "(): the test name must be a string");
    test = rest[0].as_string();
    rest.erase(rest.begin());
    if (!find_test(*test)) fail("unsupported test '" + *test + "'");
  }
  List out;
  if (!v.truthy()) return Value::iterator({});  // jinja2 guards with `if value:`, so None is empty
  for (const Value& item : walk(ev, v)) {
    Value subject = lookup(item, attribute);
    bool passed;
    if (test) {
      CallArgs test_args{rest, args.keyword};
      passed = ev.apply_test(*test, subject, test_args);
    } else {
      passed = subject.truthy();
    }
    if (passed == select) out.push_back(item);
  }
  return Value::iterator(std::move(out));
}

Value f_select(Evaluator& ev, const Value& v, CallArgs& a) {
  return select_or_reject(ev, v, a, true, false);
}
Value f_reject(Evaluator& ev, const Value& v, CallArgs& a) {
  return select_or_reject(ev, v, a, false, false);
}
Value f_selectattr(Evaluator& ev, const Value& v, CallArgs& a) {
  return select_or_reject(ev, v, a, true, true);
}
Value f_rejectattr(Evaluator& ev, const Value& v, CallArgs& a) {
  return select_or_reject(ev, v, a, false, true);
}

Value f_map(Evaluator& ev, const Value& v, CallArgs& args) {
  std::optional<std::string> attribute;
  std::optional<Value> fallback;
  for (const auto& [key, value] : args.keyword) {
    if (key == "attribute")
      attribute = value.str();
    else if (key == "default")
      fallback = value;
  }
  List out;
  if (!v.truthy()) return Value::iterator({});  // as select_or_reject
  if (attribute || args.positional.empty()) {
    if (!attribute) fail("map() needs a filter name or attribute=");
    for (const Value& item : walk(ev, v)) {
      Value mapped = lookup(item, attribute);
      out.push_back(mapped.is_undefined() && fallback ? *fallback : mapped);
    }
    return Value::iterator(std::move(out));
  }
  if (!args.positional[0].is_string()) fail("map(): the filter name must be a string");
  std::string filter = args.positional[0].as_string();
  if (!find_filter(filter)) fail("unsupported filter '" + filter + "'");
  List rest(args.positional.begin() + 1, args.positional.end());
  for (const Value& item : walk(ev, v)) {
    CallArgs filter_args{rest, args.keyword};
    out.push_back(ev.apply_filter(filter, item, filter_args));
  }
  return Value::iterator(std::move(out));
}

Value f_unique(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("unique", args, {"case_sensitive", "attribute"});
  bool case_sensitive = p.flag(0, false);
  std::optional<std::string> attribute = p.string(1);
  List out, seen;
  for (const Value& item : walk(ev, v)) {
    Value key = folded(lookup(item, attribute), case_sensitive);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); }))
      continue;
    ev.count_steps(static_cast<int64_t>(seen.size()));
    seen.push_back(key);
    out.push_back(item);
  }
  return Value::iterator(std::move(out));
}

Value f_reverse(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("reverse", args, {});
  if (v.is_string()) {
    std::u32string u = text::decode(v.as_string());
    std::reverse(u.begin(), u.end());
    return Value::string(text::encode(u));
  }
  List items = walk(ev, v);
  std::reverse(items.begin(), items.end());
  return Value::iterator(std::move(items));
}

Value f_sort(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("sort", args, {"reverse", "case_sensitive", "attribute"});
  bool reverse = p.flag(0, false), case_sensitive = p.flag(1, false);
  std::optional<std::string> attribute = p.string(2);
  List items = walk(ev, v);
  sort_items(items, [&](const Value& a, const Value& b) {
    int c = compare(folded(lookup(a, attribute), case_sensitive),
                    folded(lookup(b, attribute), case_sensitive));
    return reverse ? c > 0 : c < 0;
  });
  return Value::list(std::move(items));
}

Value f_sum(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("sum", args, {"attribute", "start"});
  std::optional<std::string> attribute = p.string(0);
  Value total = p.get_or(1, Value::integer(0));
  for (const Value& item : walk(ev, v)) total = binary_op("+", total, lookup(item, attribute), ev);
  return total;
}

Value min_or_max(Evaluator& ev, const Value& v, CallArgs& args, bool want_max) {
  Params p(want_max ? "max" : "min", args, {"case_sensitive", "attribute"});
  bool case_sensitive = p.flag(0, false);
  std::optional<std::string> attribute = p.string(1);
  List items = walk(ev, v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const Value* best = &items[0];
  for (const Value& item : items) {
    int c = compare(folded(lookup(item, attribute), case_sensitive),
                    folded(lookup(*best, attribute), case_sensitive));
    if (want_max ? c > 0 : c < 0) best = &item;
  }
  return *best;
}

Value f_min(Evaluator& ev, const Value& v, CallArgs& a) {
  return min_or_max(ev, v, a, false);
}
Value f_max(Evaluator& ev, const Value& v, CallArgs& a) {
  return min_or_max(ev, v, a, true);
}

Value f_batch(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("batch", args, {"linecount", "fill_with"});
  int64_t size = p.integer(0, 0);
  if (size <= 0) fail("batch(): linecount must be positive");
  List out, current;
  for (const Value& item : walk(ev, v)) {
    current.push_back(item);
    if (static_cast<int64_t>(current.size()) == size) {
      out.push_back(Value::list(std::move(current)));
      current.clear();
    }
  }
  if (!current.empty()) {
    if (p.has(1))
      while (static_cast<int64_t>(current.size()) < size) current.push_back(*p.get(1));
    out.push_back(Value::list(std::move(current)));
  }
  return Value::iterator(std::move(out));
}

}  // namespace

FilterFn find_sequence_filter(std::string_view name) {
  static const std::map<std::string, FilterFn, std::less<>> kFilters = {
      {"first", f_first},
      {"last", f_last},
      {"join", f_join},
      {"items", f_items},
      {"list", f_list},
      {"dictsort", f_dictsort},
      {"select", f_select},
      {"reject", f_reject},
      {"selectattr", f_selectattr},
      {"rejectattr", f_rejectattr},
      {"map", f_map},
      {"unique", f_unique},
      {"reverse", f_reverse},
      {"sort", f_sort},
      {"sum", f_sum},
      {"min", f_min},
      {"max", f_max},
      {"batch", f_batch}};
  auto it = kFilters.find(name);
  return it == kFilters.end() ? nullptr : it->second;
}

}  // namespace moeline::tokenizer::jinja
