// The JSON of tqdecode_bench: a minimal reader for bench/shapes.json and the
// pieces the writer builds its output from.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tqbench {

/// A minimal JSON reader, enough for bench/shapes.json: objects, arrays,
/// strings (no \u escapes), numbers, true, false, null.
struct Json {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> items;                            // array elements
  std::vector<std::pair<std::string, Json>> members;  // object members, in file order

  const Json* member(std::string_view key) const {
    for (const auto& [name, value] : members) {
      if (name == key) return &value;
    }
    return nullptr;
  }
};

class JsonReader {
 public:
  JsonReader(std::string text, std::string source) : text_(std::move(text)), source_(std::move(source)) {}

  Json document() {
    Json root = value();
    skip_space();
    if (pos_ != text_.size()) error("unexpected text after the document");
    return root;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    throw std::runtime_error(source_ + ": byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ == text_.size()) error("unexpected end of the document");
    return text_[pos_];
  }
  bool consume(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!consume(c)) error(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (text_.compare(pos_, word.size(), word) != 0) return false;
    pos_ += word.size();
    return true;
  }

  std::string string_literal() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ == text_.size()) error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) error("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ == text_.size()) error("unterminated string");
      const char escaped = text_[pos_++];
      const std::string_view from = "\"\\/bfnrt";
      const std::string_view to = "\"\\/\b\f\n\r\t";
      const std::size_t which = from.find(escaped);
      if (which == std::string_view::npos) error(std::string("unsupported escape \\") + escaped);
      out += to[which];
    }
  }

  Json value() {
    Json v;
    const char c = peek();
    if (c == '{') {
      ++pos_;
      v.kind = Json::Kind::object;
      if (consume('}')) return v;
      do {
        std::string key = string_literal();
        expect(':');
        v.members.emplace_back(std::move(key), value());
      } while (consume(','));
      expect('}');
    } else if (c == '[') {
      ++pos_;
      v.kind = Json::Kind::array;
      if (consume(']')) return v;
      do v.items.push_back(value());
      while (consume(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::Kind::string;
      v.string = string_literal();
    } else if (literal("true") || literal("false")) {
      v.kind = Json::Kind::boolean;
      v.boolean = c == 't';
    } else if (literal("null")) {
      v.kind = Json::Kind::null;
    } else {
      const char* begin = text_.c_str() + pos_;
      char* end = nullptr;
      v.number = std::strtod(begin, &end);
      if (end == begin) error("expected a JSON value");
      v.kind = Json::Kind::number;
      pos_ += static_cast<std::size_t>(end - begin);
    }
    return v;
  }

  std::string text_;
  std::string source_;
  std::size_t pos_ = 0;
};

inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

/// A number, or null where there is none (NaN: not measured).
inline std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

}  // namespace tqbench
