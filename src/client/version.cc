#include "client/version.h"

namespace pathways {

const char* LibraryVersion() { return PATHWAYS_VERSION_STRING; }

}  // namespace pathways
