// Checks a site's own certificate before dialling (docs/protocol.md §1): a TLS failure reaches a
// gRPC client only as UNAVAILABLE, so name the problem here instead.
import { X509Certificate } from "node:crypto";

export function checkCertificate(certPem: Buffer, caPem: Buffer, site: string, now = new Date()): string | null {
  const cert = new X509Certificate(certPem);
  const ca = new X509Certificate(caPem);
  const subject = cert.subject.replace(/\n/g, ", ");
  if (now < new Date(cert.validFrom)) return `certificate ${subject} is not valid before ${cert.validFrom}`;
  if (now > new Date(cert.validTo)) return `certificate ${subject} expired on ${cert.validTo}`;
  if (!cert.checkIssued(ca) || !cert.verify(ca.publicKey)) {
    return `certificate ${subject} is issued by ${cert.issuer.replace(/\n/g, ", ")}, not by the given CA ${ca.subject.replace(/\n/g, ", ")}`;
  }
  const uri = `spiffe://geodiloco/site/${site}`;
  if (!(cert.subjectAltName ?? "").split(", ").includes(`URI:${uri}`)) {
    return `certificate ${subject} does not name ${uri} (subject alternative names: ${cert.subjectAltName ?? "none"})`;
  }
  return null;
}
