#pragma once
// Durations as people write them on a command line or in a job script.

#include <cstdint>
#include <string>

namespace moeplan {

// "3600" (seconds), "90s", "45m", "4h", "2d", "1h30m", or SLURM's time forms "MM:SS",
// "HH:MM:SS" and "D-HH:MM:SS", in seconds. Throws InputError naming `field` when the text is
// none of these or is not positive.
int64_t parse_duration_seconds(const std::string& text, const std::string& field);

}  // namespace moeplan
