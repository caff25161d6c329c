#pragma once
// Small RGB pictures for the command-line tools (`moeline experts --png`): rectangles, lines and
// text in a 5x7 pixel font, written as PNG (zlib). Nothing a plotting library would be needed for.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace moeline::cli {

using Rgb = std::array<uint8_t, 3>;

class Picture {
 public:
  Picture(int width, int height, Rgb background);
  int width() const { return width_; }
  int height() const { return height_; }
  void fill(int x, int y, int w, int h, Rgb colour);  // clipped to the picture
  // A straight line from (x0, y0) to (x1, y1), `thickness` pixels wide; clipped.
  void line(int x0, int y0, int x1, int y1, Rgb colour, int thickness = 1);
  // Printable ASCII at (x, y) (its top left), each glyph 5x7 pixels times `scale` with one
  // column of spacing; other characters draw as '?'. Returns the width drawn.
  int text(int x, int y, const std::string& text, Rgb colour, int scale = 1);
  static int text_width(const std::string& text, int scale = 1) {
    return static_cast<int>(text.size()) * 6 * scale;
  }
  // 8-bit RGB PNG; false when the file cannot be written.
  bool write_png(const std::string& path) const;

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;  // RGB, row-major
};

}  // namespace moeline::cli
