//! Bearer-token authentication for every non-GET endpoint.
//! (Being implemented.)
