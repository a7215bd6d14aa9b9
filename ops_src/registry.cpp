// The redfuser op namespace, and what the library reports about itself (see runtime.h).
#include "runtime.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>

#ifndef REDFUSER_VERSION
#define REDFUSER_VERSION "0+unknown"
#endif
#ifndef REDFUSER_TORCH_BUILD_VERSION
#define REDFUSER_TORCH_BUILD_VERSION "unknown"
#endif
#ifndef REDFUSER_CUDA_VERSION
#define REDFUSER_CUDA_VERSION ""
#endif

namespace redfuser REDFUSER_HIDDEN {
namespace {

struct OpInfo {
  std::string schema;
  std::vector<std::tuple<std::string, std::string, std::string>> variants;  // name, device, family
};

struct Registry {
  std::mutex mu;
  std::map<std::string, OpInfo> ops;  // sorted by name
};

Registry& registry() {
  static Registry r;  // constructed on first use: safe from any static initializer
  return r;
}

void json_string(std::string& out, std::string_view s) {
  out.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

void json_string_list(std::string& out, const std::vector<std::string>& v) {
  out.push_back('[');
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    json_string(out, v[i]);
  }
  out.push_back(']');
}

std::string torch_target_version() {
  // TORCH_TARGET_VERSION is 0xMMmmpp..., e.g. 0x020A000000000000 = 2.10.0
#ifdef TORCH_TARGET_VERSION
  const unsigned long long v = TORCH_TARGET_VERSION;
  return std::to_string((v >> 56) & 0xFF) + "." + std::to_string((v >> 48) & 0xFF) + "." +
         std::to_string((v >> 40) & 0xFF);
#else
  return "unknown";
#endif
}

}  // namespace

BuildInfoEntry::BuildInfoEntry(const char* op, const char* schema,
                               std::initializer_list<VariantRecord> variants) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  OpInfo& info = r.ops[op];
  if (schema != nullptr && *schema) info.schema = schema;
  for (const VariantRecord& v : variants)
    info.variants.emplace_back(v.name, v.device ? v.device : "", v.family ? v.family : "");
}

std::string build_info_json() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> archs;
  for (const std::string& f : built_families()) archs.push_back(family_arch_list(f));
  std::string out = "{";
  out += "\"name\": \"redfuser-ops\", \"version\": ";
  json_string(out, REDFUSER_VERSION);
  out += ", \"torch_target\": ";
  json_string(out, torch_target_version());
  out += ", \"torch_built_with\": ";
  json_string(out, REDFUSER_TORCH_BUILD_VERSION);
  out += ", \"cuda\": ";
  if (built_with_cuda()) json_string(out, REDFUSER_CUDA_VERSION); else out += "null";
  out += ", \"families\": ";
  json_string_list(out, built_families());
  out += ", \"archs\": ";
  json_string_list(out, archs);
  out += ", \"ops\": {";
  bool first_op = true;
  for (auto& [name, info] : r.ops) {
    if (!first_op) out += ", ";
    first_op = false;
    json_string(out, name);
    out += ": {\"schema\": ";
    json_string(out, info.schema);
    out += ", \"variants\": [";
    auto vs = info.variants;
    std::sort(vs.begin(), vs.end());
    vs.erase(std::unique(vs.begin(), vs.end()), vs.end());
    for (size_t i = 0; i < vs.size(); ++i) {
      if (i) out += ", ";
      out += "{\"name\": ";
      json_string(out, std::get<0>(vs[i]));
      out += ", \"device\": ";
      json_string(out, std::get<1>(vs[i]));
      out += ", \"family\": ";
      json_string(out, std::get<2>(vs[i]));
      out += "}";
    }
    out += "]}";
  }
  out += "}}";
  return out;
}

namespace {

std::string op_build_info() { return build_info_json(); }

// Exposes the arch-family rule for tests without a GPU:
// _select_family("fused_attention", 7, 5, "sm80;sm90a") raises the user-facing error.
std::string op_select_family(std::string op, int64_t major, int64_t minor, std::string families) {
  std::vector<std::string> fams;
  std::string cur;
  for (char c : families) {
    if (c == ';' || c == ',' || c == ' ') {
      if (!cur.empty()) fams.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) fams.push_back(cur);
  return select_family_for_capability(op, static_cast<int>(major), static_cast<int>(minor), fams);
}

// Exposes the launch tiling rule for tests without a GPU: tensors as "name:batch_stride:extent;...".
int64_t op_batch_chunk(std::string op, int64_t batch, std::string tensors, int64_t max_grid) {
  std::vector<std::string> names;
  std::vector<BatchExtent> ts;
  size_t pos = 0;
  while (pos < tensors.size()) {
    size_t end = tensors.find(';', pos);
    if (end == std::string::npos) end = tensors.size();
    const std::string item = tensors.substr(pos, end - pos);
    const size_t a = item.find(':'), b = item.rfind(':');
    check(a != std::string::npos && b != a, op, "bad tensor spec '", item, "'");
    names.push_back(item.substr(0, a));
    ts.push_back({std::string_view(), std::stoll(item.substr(a + 1, b - a - 1)), std::stoll(item.substr(b + 1))});
    pos = end + 1;
  }
  for (size_t i = 0; i < ts.size(); ++i) ts[i].name = names[i];
  return batch_chunk(op, batch, ts, max_grid);
}

int64_t op_warm_up(int64_t device) { return warm_up(static_cast<int32_t>(device)); }

bool op_set_check_inputs(bool on) { return set_check_inputs(on); }
bool op_check_inputs() { return check_inputs_enabled(); }

}  // namespace
}  // namespace redfuser

extern "C" const char* redfuser_build_info_json() {
  static std::string cached;
  static std::once_flag once;
  std::call_once(once, [] { cached = redfuser::build_info_json(); });
  return cached.c_str();
}

// The one definition of the namespace; generated code uses STABLE_TORCH_LIBRARY_FRAGMENT.
STABLE_TORCH_LIBRARY(redfuser, m) {
  m.def("_build_info() -> str");
  m.def("_select_family(str op, int major, int minor, str families) -> str");
  m.def("_set_check_inputs(bool on) -> bool");
  m.def("_warm_up(int device) -> int");
  m.def("_batch_chunk(str op, int batch, str tensors, int max_grid=65535) -> int");
  m.def("_check_inputs() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(redfuser, CompositeExplicitAutograd, m) {
  m.impl("_build_info", TORCH_BOX(&redfuser::op_build_info));
  m.impl("_select_family", TORCH_BOX(&redfuser::op_select_family));
  m.impl("_set_check_inputs", TORCH_BOX(&redfuser::op_set_check_inputs));
  m.impl("_warm_up", TORCH_BOX(&redfuser::op_warm_up));
  m.impl("_batch_chunk", TORCH_BOX(&redfuser::op_batch_chunk));
  m.impl("_check_inputs", TORCH_BOX(&redfuser::op_check_inputs));
}
